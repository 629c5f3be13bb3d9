"""Task generators shared by the training programs (`train/`) and the evaluation programs (`eval/`)."""
