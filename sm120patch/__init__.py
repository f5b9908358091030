"""sm120patch: apply, verify and revert the SM120 enablement patches for SGLang and FlashInfer."""

__version__ = "0.2.1"
