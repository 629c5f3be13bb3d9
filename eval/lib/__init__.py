"""What eval/'s programs share: report writing and load recording, timing, the docs' tables, policy specs,
the retrieval tasks and the sweep runner. Imports kvjax and itself, never a program (tests/test_architecture.py)."""
