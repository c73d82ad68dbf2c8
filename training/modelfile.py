"""model.pt, typed: what a run hands on to jobs.predict, jobs.evaluate and plain torchvision.

    ModelFile(arch=..., state_dict=..., ...).to_state()    # torch.save: tensors and plain data
    ModelFile.from_state(torch.load(f, weights_only=True), path)

The file itself stays a plain dict (torch.load with weights_only=True reads it without this
project: docs/guide.md, "Prediction and evaluation"); this object is how the project reads and
writes it. training/driver/results.py model_bytes writes one; training/predict/inference.py load_model_file
checks a file's values and returns one. A file of another MODELFILE_VERSION is one line
(StaleModelFile), not read field by field. Light: no torch import.
"""

from __future__ import annotations

import dataclasses

REQUIRED = ("arch", "state_dict", "class_names", "image_size", "small_stem", "eval_transform", "config")
MODELFILE_VERSION = 2  # model.pt's layout; files written before the field was added are version 1


class StaleModelFile(ValueError):
    """A model.pt of another version of this job."""


def check_version(state: dict) -> None:
    """StaleModelFile unless `state` (a jobs.train model.pt, as torch.load reads it) is of
    MODELFILE_VERSION."""
    version = state.get("version", 1)
    if version != MODELFILE_VERSION:
        raise StaleModelFile(
            f"a model.pt of version {version} of jobs.train, this one reads version {MODELFILE_VERSION}; "
            "train the model again with this version, or use the version that trained it"
        )


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
    version: int = MODELFILE_VERSION  # model.pt's layout
    path: str = ""  # where it was read from ("" for one built in memory); not written

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def setting(self, name: str, default):
        """A --flag of the run that trained it (config.json's), or `default` for one built in memory
        without the run's config."""
        return self.config.get(name, default)

    def to_state(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "path"}
        return state | {"class_names": list(self.class_names)}

    @classmethod
    def from_state(cls, state: dict, path: str = "") -> ModelFile:
        """From a dict of this MODELFILE_VERSION (else StaleModelFile) that holds REQUIRED
        (load_model_file checks them and their values first)."""
        check_version(state)
        known = {f.name for f in dataclasses.fields(cls)} - {"path"}
        kept = {k: v for k, v in state.items() if k in known}
        return cls(**kept | {"class_names": tuple(state["class_names"]), "path": path})
