"""The one error type of conversion, below every converter so family modules can raise it."""


class ConversionError(ValueError):
    """A checkpoint or model that does not fit a conversion; the message names the file or family and field."""
