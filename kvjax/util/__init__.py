"""Small pure-Python helpers with no model or cache knowledge: block hashing, a byte-bounded LRU, the
compile counter and the persistent compilation cache switch."""
