"""model.pt, typed: what a run hands on to jobs.predict, jobs.evaluate and plain torchvision.

    ModelFile(arch=..., state_dict=..., ...).to_state()    # torch.save: tensors and plain data
    ModelFile.from_state(torch.load(f, weights_only=True), path)

The file itself stays a plain dict (torch.load with weights_only=True reads it without this
project: docs/guide.md, "Prediction and evaluation"); this object is how the project reads and
writes it. training/driver/results.py model_bytes writes one; training/predict/inference.py load_model_file
checks a file's values and returns one. Light: no torch import.
"""

from __future__ import annotations

import dataclasses

REQUIRED = ("arch", "state_dict", "class_names", "image_size", "small_stem", "eval_transform")


@dataclasses.dataclass(frozen=True)
class ModelFile:
    arch: str  # --model: a torchvision classifier's name, timm/NAME or module.path:function
    state_dict: dict  # its weights
    class_names: tuple[str, ...]  # output i is class_names[i]
    image_size: int  # the side the model saw
    small_stem: bool  # conv1 3x3 stride 1 and no max-pool (training/model.py)
    eval_transform: dict  # {"ops": the project's eval op list, "mean": [...], "std": [...]}
    torchvision_model: dict | None = None  # get_model's arguments and the layers the small stem replaces
    model_source: dict | None = None  # how to rebuild it: {"kind": torchvision/timm/callable, and its arguments}
    weights: dict | None = None  # the first weights: --weights (name, their transform) or --init-weights (file)
    torchvision_eval: list | None = None  # the eval steps as torchvision.transforms.v2 classes; None: none
    config: dict = dataclasses.field(default_factory=dict)  # the run's TrainConfig.to_dict()
    path: str = ""  # where it was read from ("" for one built in memory); not written

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def setting(self, name: str, default):
        """A --flag of the run that trained it (config.json's), or `default` for an older file."""
        return self.config.get(name, default)

    def to_state(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "path"}
        return state | {"class_names": list(self.class_names)}

    @classmethod
    def from_state(cls, state: dict, path: str = "") -> ModelFile:
        """From a dict that holds REQUIRED (load_model_file checks them and their values first)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"path"}
        kept = {k: v for k, v in state.items() if k in known}
        config = kept.get("config") if isinstance(kept.get("config"), dict) else {}  # an older or edited file
        return cls(**kept | {"class_names": tuple(state["class_names"]), "config": config, "path": path})
