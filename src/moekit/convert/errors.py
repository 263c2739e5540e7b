"""The one error type of conversion, below every converter so family modules can raise it."""


class ConversionError(ValueError):
    """A checkpoint or model that does not fit a conversion; the message names the file or family and field."""


def unfit(model_type: str, what: str) -> ConversionError:
    """``what`` (a config field and its value) that moekit's model cannot express, for ``model_type``."""
    return ConversionError(f"{model_type}: {what} does not fit moekit's model")
