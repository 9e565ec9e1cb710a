"""sglfleet: deploy and operate SGLang + DDTree on your own GPU hosts over SSH."""

__version__ = "0.1.0"
