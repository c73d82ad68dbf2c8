"""What the augment package tells users about presets, without importing torch: entry
points check a preset's name before anything heavy starts."""

BUILTIN_PRESETS = ("cifar", "imagenet")  # the keys of augment.presets.PRESETS (a test holds them equal)
BUILTIN_TRAIN_SIZES = {"cifar": 32, "imagenet": 224}  # their train_size (the same test holds them equal)
PRESET_FILE_SUFFIXES = (".yaml", ".yml", ".json")


class PresetError(ValueError):
    """A preset name or file the user gave is unusable; the message lists what is valid."""


def check_preset_name(name: str) -> bool:
    """True for a preset file's path (to be loaded and checked), False for a built-in name;
    PresetError for anything else."""
    if name in BUILTIN_PRESETS:
        return False
    if name.lower().endswith(PRESET_FILE_SUFFIXES):
        return True
    raise PresetError(
        f"unknown preset {name!r}; built-in presets: {sorted(BUILTIN_PRESETS)}, or a path to a .yaml/.json preset file"
    )
