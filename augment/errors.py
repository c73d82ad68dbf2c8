"""The augment package's one error: a preset name or file the user gave is unusable."""


class PresetError(ValueError):
    """A preset name or file the user gave is unusable; the message lists what is valid."""
