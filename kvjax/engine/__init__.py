"""The step and everything that drives it: the one append/compress step (`step`), the on-device decode
loop (`decode_loop`), the public generate/prefill/decode_step and their host loops (`generation`), the
shared prefill (`shared_prefill`) and sampling."""
