"""The datasets jobs.train, jobs.predict and jobs.evaluate build: no task carries a per-file
table, every epoch reads the files in a new order drawn from (seed, epoch), and decoding
happens where the plan line says (docs/design.md, "Data flow")."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import ray.data
import torch
from ray import cloudpickle

from augment.presets import PRESETS
from tests.conftest import write_tree
from training.config import ConfigError, TrainConfig
from training.driver import planning
from training.forms.data import ImageTree, ShardFormat, make_split, sharded
from training.stream.ingest import build_datasets, choose_decode

CPU_2 = planning.Capacity(cpus=2, gpus=0, hosts=1)


def _fake_tree(n: int) -> ImageTree:
    """A tree of n paths that do not exist: building the datasets reads nothing."""
    names = ("cat", "dog", "eel")
    rel = [f"{names[i % 3]}/{i:07d}.jpg" for i in range(n)]
    split = make_split("/nowhere/photos", rel, [i % 3 for i in range(n)], np.full(n, 50_000))
    return ImageTree("/nowhere/photos", "hash", names, split, split.subset(np.arange(n) < n // 5))


class _Recorder:
    """Every map_batches call and every datasource that the code under test hands Ray Data."""

    def __init__(self, monkeypatch):
        self.pickled: list[tuple[str, int]] = []
        original_map, original_read = ray.data.Dataset.map_batches, ray.data.read_datasource

        def map_batches(ds, fn, *args, **kwargs):
            for name in ("fn_args", "fn_kwargs", "fn_constructor_args", "fn_constructor_kwargs"):
                self.pickled.append((f"{getattr(fn, '__name__', fn)}.{name}", len(cloudpickle.dumps(kwargs.get(name)))))
            self.pickled.append((f"{getattr(fn, '__name__', fn)}", len(cloudpickle.dumps(fn))))
            return original_map(ds, fn, *args, **kwargs)

        def read_datasource(source, **kwargs):
            self.pickled.append((type(source).__name__, len(cloudpickle.dumps(source))))
            return original_read(source, **kwargs)

        monkeypatch.setattr(ray.data.Dataset, "map_batches", map_batches)
        monkeypatch.setattr(ray.data, "read_datasource", read_datasource)


@pytest.mark.parametrize(
    "settings",
    [
        {"preset": "cifar"},  # decode in the read task, augment tasks
        {"preset": "imagenet", "decode": "augment"},  # decode + augment in one call
        {"preset": "imagenet", "augment_actors": 1},  # an actor pool: constructor arguments
    ],
)
def test_no_map_function_or_argument_grows_with_the_dataset(ray_cluster, monkeypatch, settings):
    sizes = {}
    for n in (1_000, 100_000):
        recorder = _Recorder(monkeypatch)
        cfg = TrainConfig(**settings)
        build_datasets(cfg, _fake_tree(n), PRESETS[cfg.preset], planning.plan_resources(cfg, CPU_2), clock=None)
        sizes[n] = recorder.pickled
        monkeypatch.undo()
    _same_sizes(sizes[1_000], sizes[100_000])


def _fake_sharded_tree(n: int, kind: str) -> ImageTree:
    """n images in shards that do not exist, 2,560 a shard in units of 256: 1 shard for 2,560
    images, 100 for 256,000."""
    names = ("cat", "dog", "eel")
    split = make_split(
        "/nowhere/shards", [f"x:{i}" for i in range(n)], np.arange(n) % 3, np.full(n, 50_000), keys=np.arange(n)
    )
    units = [(g // 10, g % 10, g % 10 * 256, 256) for g in range(n // 256)]
    form = ShardFormat(kind, class_names=names if kind == "webdataset" else ())
    train = sharded(split, [f"/nowhere/shards/{s:05d}.tar" for s in range(n // 2560)], units, form)
    return ImageTree("/nowhere/shards", "hash", names, train, train)


@pytest.mark.parametrize("kind", ["prepared", "webdataset", "huggingface"])
def test_a_sharded_source_grows_neither_with_its_images_nor_with_its_shards(ray_cluster, monkeypatch, kind):
    sizes = {}
    for n in (2_560, 256_000):
        recorder = _Recorder(monkeypatch)
        cfg = TrainConfig(preset="cifar")
        build_datasets(cfg, _fake_sharded_tree(n, kind), PRESETS["cifar"], planning.plan_resources(cfg, CPU_2), None)
        sizes[n] = recorder.pickled
        monkeypatch.undo()
    _same_sizes(sizes[2_560], sizes[256_000])


def _same_sizes(small: list, large: list) -> None:
    """Every pickled map function and argument: the same bytes. The read source: the same up to
    the digits of its counts (files, rows, bytes), as its table went to the object store."""
    assert [name for name, _ in small] == [name for name, _ in large]
    assert any(name == "SplitSource" for name, _ in small)
    for (name, a), (_, b) in zip(small, large, strict=True):
        assert (a == b) if name != "SplitSource" else abs(a - b) <= 12, (name, a, b)


def test_predict_and_evaluate_datasets_do_not_grow_with_the_dataset(ray_cluster, monkeypatch):
    """jobs.predict and jobs.evaluate both score through inference.scoring_dataset."""
    from training.modelfile import ModelFile
    from training.predict.inference import scoring_dataset

    info = ModelFile(
        arch="resnet18",
        state_dict={},
        class_names=("cat", "dog", "eel"),
        image_size=32,
        small_stem=True,
        eval_transform={"ops": [{"center_crop": {"size": 32}}], "mean": [0.5] * 3, "std": [0.5] * 3},
    )
    sizes = {}
    for n in (1_000, 100_000):
        recorder = _Recorder(monkeypatch)
        tree = _fake_tree(n)
        scoring_dataset(info, [tree.train, tree.val])
        sizes[n] = recorder.pickled
        monkeypatch.undo()
    assert len(sizes[1_000]) >= 6
    _same_sizes(sizes[1_000], sizes[100_000])


def _pairs(keys) -> set:
    return set(zip(keys[:-1], keys[1:], strict=True))


@pytest.fixture(scope="module")
def order_tree(tmp_path_factory):
    return write_tree(tmp_path_factory.mktemp("order"), {"a": 90, "b": 90, "c": 90}, size=(8, 8))


def _epoch_keys(cfg, tree, clock, epochs) -> list[list[int]]:
    ds = build_datasets(cfg, tree, PRESETS["cifar"], planning.plan_resources(cfg, CPU_2), clock)["train"]
    out = []
    for epoch in epochs:
        ray.get(clock.set.remote(epoch))
        out.append([int(k) for b in ds.iter_batches(batch_size=None, batch_format="numpy") for k in b["key"]])
    return out


def test_every_epoch_reads_a_new_order_from_seed_and_epoch(ray_cluster, order_tree):
    from training.forms.formats import scan_data
    from training.stream.stamp import EpochClock

    tree = scan_data(str(order_tree), 0.1)
    assert len(tree.train) > 200
    cfg = TrainConfig(data=str(order_tree), val_fraction=0.1, augment_batch_size=32)
    context = ray.data.DataContext.get_current()
    before = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # as --deterministic sets it
    clock = ray.remote(num_cpus=0)(EpochClock).remote()
    try:
        straight = _epoch_keys(cfg, tree, clock, [0, 1, 2])
        resumed = _epoch_keys(cfg, tree, clock, [2])  # fresh datasets, as a run resumed at epoch 2 builds
        again = _epoch_keys(cfg, tree, clock, [0])  # a second run with the same seed
        other_seed = _epoch_keys(TrainConfig(**{**cfg.to_dict(), "seed": 1}), tree, clock, [0])
    finally:
        context.execution_options.preserve_order = before
        ray.kill(clock)
    everything = sorted(int(k) for k in tree.train.keys)
    for keys in straight:
        assert sorted(keys) == everything  # every image exactly once per epoch
    for a, b in ((straight[0], straight[1]), (straight[1], straight[2])):
        assert len(_pairs(a[:200]) & _pairs(b[:200])) <= 3  # ~0.7 expected by chance
    assert resumed[0] == straight[2] and again[0] == straight[0]
    assert other_seed[0] != straight[0]


def test_decode_rule_by_device_preset_and_file_size(monkeypatch):
    tree = _fake_tree(100)
    small = make_split("/x", ["a/1.png"], [0], [3_000])
    imagenet, cifar = PRESETS["imagenet"].train, PRESETS["cifar"].train
    assert choose_decode("auto", tree.train, imagenet, use_gpu=False).where == "augment"
    assert choose_decode("auto", tree.train, imagenet, use_gpu=False).shrink
    assert choose_decode("auto", small, imagenet, use_gpu=False).where == "read"  # tiny files
    assert choose_decode("auto", tree.train, cifar, use_gpu=False).where == "read"  # no crop to shrink into
    gpu = choose_decode("auto", small, cifar, use_gpu=True)
    assert (gpu.where, gpu.shrink) == ("augment", False) and "nvImageCodec (hardware JPEG engines" in gpu.describe()
    monkeypatch.setattr("augment.engines.available", lambda: False)  # the package not installed
    gpu = choose_decode("auto", small, cifar, use_gpu=True)
    assert "torchvision's nvjpeg (nvImageCodec not installed: pip install -e '.[gpu]')" in gpu.describe()
    forced = choose_decode("auto", small, cifar, use_gpu=True, gpu="nvjpeg").describe()
    assert "GPU: torchvision's nvjpeg (--gpu-decoder nvjpeg) in the augment call" in forced
    assert not choose_decode("augment-full", tree.train, imagenet, use_gpu=False).shrink
    assert choose_decode("read", tree.train, imagenet, use_gpu=False).where == "read"


def test_thumbnails_decoded_in_the_read_task_go_1024_to_a_task_unless_the_flag_says_otherwise():
    from training.stream.ingest import augment_rows

    photos, thumbs = _fake_tree(100).train, make_split("/x", ["a/1.png"], [0], [3_000])
    imagenet, cifar = PRESETS["imagenet"].train, PRESETS["cifar"].train
    read_thumbs = choose_decode("auto", thumbs, cifar, use_gpu=False)
    assert augment_rows(0, thumbs, read_thumbs) == 1024
    assert augment_rows(64, thumbs, read_thumbs) == 64  # --augment-batch-size wins
    assert augment_rows(0, photos, choose_decode("auto", photos, imagenet, use_gpu=False)) == 256
    assert augment_rows(0, photos, choose_decode("auto", photos, cifar, use_gpu=False)) == 256  # not thumbnails
    on_gpu = choose_decode("auto", thumbs, cifar, use_gpu=True)
    assert augment_rows(0, thumbs, on_gpu, use_gpu=True) == 1024  # the GPU decodes, in batches of 1,024
    assert augment_rows(256, photos, on_gpu, use_gpu=True) == 256
    camera = make_split("/x", ["a/1.jpg", "a/2.jpg"], [0, 0], [4_000_000, 5_000_000])
    assert augment_rows(0, camera, on_gpu, use_gpu=True) == 256  # 1,024 of these decoded whole: GBs a task
    with pytest.raises(ConfigError, match="--augment-batch-size must be 0"):
        TrainConfig(augment_batch_size=-1)


@pytest.mark.parametrize(
    "layout, rows",
    [
        ("gggxggggg", [3, 3, 2]),  # a bad file in the middle of a block
        ("xgggggggg", [3, 3, 2]),  # first
        ("ggggggggx", [3, 3, 2]),  # last
        ("gggggg", [3, 3]),  # the good images fill the last block exactly: no empty one after it
        ("xx", [0]),  # every file bad: one empty block
    ],
)
def test_a_read_task_that_decodes_yields_a_block_per_cap_of_pixels(tmp_path, monkeypatch, layout, rows):
    """Every good file once, in order, in blocks of at most DECODED_BLOCK_BYTES of pixels (3
    images of 32x32 here); the bad files (x) reported once, by the task's last block."""
    from training.stream import ingest

    root = write_tree(tmp_path / "t", {"a": 5, "b": 5}, size=(32, 32))
    good = iter(f"{c}/{i:03d}.png" for i in range(5) for c in "ab")
    rel = [next(good) if kind == "g" else f"a/broken{i}.png" for i, kind in enumerate(layout)]
    for r in rel:
        if "broken" in r:
            (root / r).write_bytes(b"not an image")
    monkeypatch.setattr(ingest, "DECODED_BLOCK_BYTES", 3 * 32 * 32 * 3)
    reported = []
    log = SimpleNamespace(add=SimpleNamespace(remote=reported.append))  # the BadFileLog actor's handle
    blocks = list(
        ingest._read_files(
            _rows(rel),
            root=str(root),
            decode=True,
            bad_log=log,
            relative_paths=True,
        )
    )
    assert [b.num_rows for b in blocks] == rows
    paths = [p for b in blocks for p in b.column("path").to_pylist()]
    assert paths == [r for r in rel if "broken" not in r]
    assert [int(x) for b in blocks for x in b.column("label").to_pylist()] == [int(p[0] == "b") for p in paths]
    bad = [r for r in rel if "broken" in r]
    assert [[path for path, _ in batch] for batch in reported] == ([bad] if bad else [])


@pytest.mark.parametrize("decode", [False, True])
def test_a_read_task_writes_the_epoch_it_read_for_into_every_row(tmp_path, decode):
    """The epoch comes with the rows (EPOCH, from the clock once an execution): the augment
    stage draws for it and asks no actor."""
    from training.stream import ingest

    root = write_tree(tmp_path / "t", {"a": 3, "b": 3}, size=(8, 8))
    rel = [f"{c}/{i:03d}.png" for i in range(3) for c in "ab"]
    blocks = list(ingest._read_files(_rows(rel), 5, root=str(root), decode=decode, bad_log=None, relative_paths=True))
    assert [int(e) for b in blocks for e in b.column("epoch").to_pylist()] == [5] * 6


def _rows(rel_paths):
    """A read task's table of files, labelled by their class directory (a or b)."""
    import pyarrow as pa

    return pa.table({"path": rel_paths, "label": [int(r[0] == "b") for r in rel_paths], "key": range(len(rel_paths))})


def _gate():
    """(Gate, wait_at), made here so that Ray ships them to its workers by value (tests/ is no
    package the workers can import). A Gate records when each task came to it (this machine's
    clock); wait_at, in a task, waits there until `release`, until `count` tasks have come (a
    barrier), or until `hold_s` after the first came, whichever is first."""

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self, count: int = 0, hold_s: float = 0.0):
            self.arrivals, self.count, self.hold_s, self.released = [], count, hold_s, False

        def arrive(self) -> None:
            import time

            self.arrivals.append(time.time())

        def release(self) -> None:
            self.released = True

        def passable(self) -> bool:
            import time

            held_long_enough = self.hold_s and time.time() >= self.arrivals[0] + self.hold_s
            return self.released or 0 < self.count <= len(self.arrivals) or bool(held_long_enough)

        def times(self) -> list[float]:
            return self.arrivals

    def wait_at(gate, timeout: float = 60.0) -> None:
        import time

        ray.get(gate.arrive.remote())
        deadline = time.time() + timeout
        while not ray.get(gate.passable.remote()) and time.time() < deadline:
            time.sleep(0.005)

    return Gate, wait_at


def _task_starts(ds, hold_s: float = 1.5) -> list[float]:
    """When each task of an execution of `ds` started, in order; every task is held at a gate
    until `hold_s` after the first started, so that none ends within the execution's first
    second, however slowly the machine runs."""
    Gate, wait_at = _gate()

    def held(batch, gate):
        wait_at(gate)
        return {"n": np.array([1])}

    warm = Gate.remote()
    ray.get(warm.release.remote())
    ds.map_batches(held, fn_kwargs={"gate": warm}, batch_size=None, batch_format="numpy", num_cpus=0.5).materialize()
    gate = Gate.remote(hold_s=hold_s)  # a first execution started the worker processes: this one measures Ray Data
    ds.map_batches(held, fn_kwargs={"gate": gate}, batch_size=None, batch_format="numpy", num_cpus=0.5).take_all()
    starts = sorted(ray.get(gate.times.remote()))
    for actor in (warm, gate):
        ray.kill(actor)
    return starts


def _started_at_once(starts: list[float], window_s: float = 0.5) -> int:
    """How many tasks started within `window_s` of the first, which starts the execution (Ray
    Data runs one task even while its limits are zero); one at a time: 1."""
    return sum(start < starts[0] + window_s for start in starts)


def test_an_execution_runs_tasks_side_by_side_from_its_first_second(ray_cluster, order_tree):
    """Ray Data 2.60 starts every execution with resource limits of zero, for a second: one
    task at a time (the control, with Ray's own method). SplitSource makes this process ask
    until the limits are known (training/ray_private.py data_limits_from_the_start). Each task
    waits at a gate until the first second is over, so a slow machine cannot end one early and
    let the next start in its place; starts count from the first task's, which begins the
    execution."""
    from ray.data._internal.execution.resource_manager import ResourceManager

    from training.forms.formats import scan_data
    from training.stream.ingest import read_split

    patched = ResourceManager.get_global_limits
    original = getattr(patched, "__wrapped__", patched)
    ResourceManager.get_global_limits = original
    try:
        control = _task_starts(ray.data.range(8, override_num_blocks=8))
        tree = scan_data(str(order_tree), 0.1)
        ours = _task_starts(read_split(tree.train, num_cpus=0.5))
    finally:
        if patched is not original:  # as it was; else read_split has just put the workaround in place
            ResourceManager.get_global_limits = patched
    # Ray's own start (the control) ran one task at a time in most runs but not in every one (a
    # first second that ends early), so it is the bar ours must clear, not a verdict of its own
    assert len(control) == 8, control
    assert _started_at_once(ours) >= max(3, _started_at_once(control)), (ours, control)  # 4 CPUs at 0.5: up to 8


def _task_processes(split, args: dict, executions: int) -> list[dict[str, int]]:
    """{task id: worker process (pid)} of an augment-like map's tasks, per execution; every task
    must have held a GPU."""
    import os

    from training.stream.ingest import read_split

    def who(batch):
        task = ray.get_runtime_context().get_task_id()
        return {"pid": np.array([os.getpid()]), "task": np.array([task]), "gpus": np.array([len(ray.get_gpu_ids())])}

    ds = read_split(split, num_cpus=0.5)
    ds = ds.map_batches(who, batch_size=32, batch_format="numpy", **args)  # Ray wants a size where tasks hold GPUs
    pids = []
    for _ in range(executions):
        rows = ds.take_all()
        assert len(rows) == -(-len(split) // 32) and all(int(r["gpus"]) == 1 for r in rows)
        pids.append({str(r["task"]): int(r["pid"]) for r in rows})
    return pids


def test_gpu_augment_tasks_run_in_processes_that_outlive_the_epoch(gpu_node, order_tree):
    """On a GPU share the augment tasks' worker processes outlive the execution
    (task_resources: max_calls=0), as CPU tasks' do. Ray's default for GPU tasks, the control,
    is a fresh process per task, and on a GPU each fresh process pays CUDA's start-up in its
    first batch (about 7 s on an H200). The GPU is a fake node's: Ray schedules by it; torch
    sees no CUDA."""
    from training.forms.formats import scan_data
    from training.stream.stage import task_resources

    plan = planning.plan_resources(TrainConfig(device="cuda"), planning.Capacity(cpus=16, gpus=1, hosts=1))
    assert plan.augment_tasks and "augment tasks x (0.0625 GPU + 1 CPU)" in plan.describe()
    args = task_resources(plan)
    assert (args["num_gpus"], args["max_calls"], plan.gpus_per_worker) == (0.0625, 0, 0.75) and "num_cpus" not in args
    assert args["compute"].size == 4  # the 4 tasks planned beside the one trainer, not the 16 that fit
    args = args | {"num_cpus": 0.5}  # the fake node's 2 CPUs take 4 tasks at once
    tree = scan_data(str(order_tree), 0.1)
    ours = _task_processes(tree.train, args, executions=2)
    # Ray ends idle workers beyond a node's CPU count, so some of the first processes may be gone
    first, second = (set(tasks.values()) for tasks in ours)
    assert first & second and len(first) + len(second) < len(ours[0]) + len(ours[1]), ours
    rays_default = {k: v for k, v in args.items() if k != "max_calls"}
    (control,) = _task_processes(tree.train, rays_default, executions=1)
    assert len(set(control.values())) == len(control) >= 4, control  # a process per task


def _task_gpus(split, args: dict) -> list[dict]:
    """Per task of an augment-like map: the GPU Ray gave it, CUDA_VISIBLE_DEVICES as the task
    saw it, and the index training.stream.stage.cuda_index derives from the two."""
    import os

    from training.stream.ingest import read_split
    from training.stream.stage import cuda_index

    Gate, wait_at = _gate()
    both = Gate.remote(count=2)  # a barrier: the first two tasks overlap, and so hold both GPUs

    def where(batch):
        wait_at(both)
        gpu, visible = ray.get_gpu_ids()[0], os.environ.get("CUDA_VISIBLE_DEVICES")
        return {"row": np.array([[int(gpu), cuda_index(gpu, visible)]]), "visible": np.array([str(visible)])}

    ds = read_split(split, num_cpus=0.5).map_batches(where, batch_size=16, batch_format="numpy", **args)
    rows = ds.take_all()
    ray.kill(both)
    return [{"gpu": r["row"][0], "index": r["row"][1], "visible": r["visible"]} for r in rows]


@pytest.mark.parametrize("gpu_node", [{"num_gpus": 2, "env_vars": {"CUDA_VISIBLE_DEVICES": "5,7"}}], indirect=True)
def test_a_gpu_augment_task_picks_the_gpu_ray_gave_it_on_a_node_of_several(gpu_node, order_tree):
    """A task's process outlives it and may get the node's other GPU in its next task. Ray
    narrows CUDA_VISIBLE_DEVICES to each task's GPU (the control), but CUDA reads it once per
    process, so a process would stay on its first GPU. The augment tasks keep the node's
    devices visible (GPU_TASK_ENV) and take the index of the id Ray gave them: on this node,
    whose GPUs are CUDA's 5 and 7, GPU "7" is torch's cuda:1."""
    from training.forms.formats import scan_data
    from training.stream.stage import task_resources

    plan = planning.plan_resources(
        TrainConfig(device="cuda", augment_gpus=0.75), planning.Capacity(cpus=16, gpus=2, hosts=1)
    )  # one task per GPU at a time: two at once use both GPUs
    assert plan.augment_concurrency == 2
    args = task_resources(plan) | {"num_cpus": 0.5}
    tree = scan_data(str(order_tree), 0.1)
    ours = []
    while len(ours) < 5 * len(tree.train) // 16 and {r["gpu"] for r in ours} != {5, 7}:
        ours += _task_gpus(tree.train, args)  # until tasks have overlapped (and used GPU 7)
    assert {r["gpu"] for r in ours} == {5, 7}, ours
    assert all(r["visible"] == "5,7" and r["index"] == {5: 0, 7: 1}[r["gpu"]] for r in ours), ours
    control = _task_gpus(tree.train, {k: v for k, v in args.items() if k != "runtime_env"})
    assert all(r["visible"] == str(r["gpu"]) for r in control), control  # narrowed, task by task


def test_a_gpu_task_where_torch_finds_no_cuda_fails_unless_the_node_says_its_gpus_are_fake(monkeypatch):
    """Augmenting on the CPU of a GPU node would pass every check but the speed: only a node that
    declares its GPUs fake (a test cluster's gpu_node) may."""
    from training.stream.stage import FAKE_GPUS_ENV, task_device

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(FAKE_GPUS_ENV, raising=False)
    with pytest.raises(RuntimeError, match="Ray gave this task GPU 0, but torch .* finds no CUDA device"):
        task_device()
    monkeypatch.setenv(FAKE_GPUS_ENV, "1")
    assert task_device() == "cpu"
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.delenv(FAKE_GPUS_ENV)
    assert task_device() == "cpu"  # no GPU given: the CPU, as planned


def test_cuda_index_follows_the_nodes_visible_devices():
    from training.stream.stage import cuda_index

    assert cuda_index(1, None) == 1 and cuda_index("1", "") == 1  # no CUDA_VISIBLE_DEVICES: Ray's ids are torch's
    assert cuda_index("3", "2,3") == 1 and cuda_index(" GPU-b", "GPU-a, GPU-b") == 1  # Ray's ids are its entries
    with pytest.raises(RuntimeError, match="GPU 5, which CUDA_VISIBLE_DEVICES=2,3 does not list"):
        cuda_index(5, "2,3")


def _augmented(cfg, tree, plan, clock, epochs=(0, 1)) -> list[dict]:
    """{key: augmented image} of train and of val, per epoch, from the datasets as jobs.train builds them."""
    datasets = build_datasets(cfg, tree, PRESETS["cifar"], plan, clock)
    out = []
    for epoch in epochs:
        ray.get(clock.set.remote(epoch))
        for name in ("train", "val"):
            batches = list(datasets[name].iter_batches(batch_size=None, batch_format="numpy"))
            assert all((b["epoch"] == (epoch if name == "train" else 0)).all() for b in batches)  # val: fixed
            out.append({int(k): img for b in batches for k, img in zip(b["key"], b["image"], strict=True)})
    return out


AUGMENT_TASK = "MapBatches(augment_task)"  # the GPU plan's: the read tasks ask for other resources


def _tasks(name: str) -> dict[str, dict]:
    """{task id: the resources it asked for} of the session's tasks called `name` (Ray's state API,
    given the session cluster's address: else it asks the cluster on this machine that started last)."""
    from ray.util.state import list_tasks

    address = ray.get_runtime_context().gcs_address
    filters = [("name", "=", name)]
    tasks = list_tasks(address=address, filters=filters, detail=True, limit=10_000, raise_on_missing_output=False)
    return {t.task_id: t.required_resources for t in tasks}


def _new_tasks(seen: set[str], name: str = AUGMENT_TASK) -> list[dict]:
    """The resources asked for by the tasks called `name` that are not in `seen` (task ids,
    updated): Ray's task events reach its state API a second or so after the tasks ran."""
    import time

    found, deadline = {}, time.time() + 30
    while time.time() < deadline:
        new = {k: v for k, v in _tasks(name).items() if k not in seen}
        if new and new == found:  # the same twice: every event is in
            break
        found = new
        time.sleep(1)
    seen |= set(found)
    return list(found.values())


@pytest.mark.parametrize("source", ["files", "prepared shards"])
def test_the_gpu_plans_datasets_augment_as_the_cpu_plans_do(gpu_node, order_tree, source, tmp_path):
    """The GPU branch of build_datasets (read tasks hand encoded files to augment tasks on a
    GPU share, a batch at a time) runs on a fake GPU node, where torch sees no CUDA and the
    augment tasks fall back to the CPU: every image of both splits, in two epochs, comes out
    as the CPU plan augments it (each image's augmentation is a function of seed, epoch, key).
    Ray's task records show that the GPU plan's augment tasks asked for their GPU share (the
    CPU plan's read tasks augment, and ask for none).
    Prepared shards read by row groups, which may hand the map fewer blocks than batches."""
    from jobs.prepare import main as prepare
    from training.forms.formats import scan_data
    from training.stream.stamp import EpochClock

    data = str(order_tree)
    if source == "prepared shards":
        data = str(tmp_path / "prepared")
        assert prepare([str(order_tree), data, "--val-fraction", "0.1", "--shard-mb", "0.002"]) == 0
    tree = scan_data(data, 0.1)
    cfg = TrainConfig(data=data, val_fraction=0.1, augment_batch_size=32, decode="augment-full")
    gpu_plan = planning.plan_resources(TrainConfig(**{**cfg.to_dict(), "device": "cuda"}), planning.Capacity(4, 1, 1))
    assert gpu_plan.augment_gpus == 0.0625 and gpu_plan.augment_tasks
    clock = ray.remote(num_cpus=0)(EpochClock).remote()
    read = "ReadImages" if source == "files" else "ReadShardedImages"  # the CPU plan fuses it with the augment call
    cpu_task = f"Read{read}->{AUGMENT_TASK}"
    seen = set(_tasks(AUGMENT_TASK)) | set(_tasks(cpu_task))  # earlier tests'
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on_gpu = _augmented(cfg, tree, gpu_plan, clock)
        gpu_tasks = _new_tasks(seen)
        on_cpu = _augmented(cfg, tree, planning.plan_resources(cfg, CPU_2), clock)
        cpu_tasks = _new_tasks(seen, cpu_task)
    finally:
        ray.kill(clock)
    assert len(gpu_tasks) >= 4 and all(r.get("GPU") == 0.0625 for r in gpu_tasks), gpu_tasks  # 2 splits x 2 epochs
    assert cpu_tasks and not any("GPU" in r for r in cpu_tasks), cpu_tasks
    # the cap on GPU tasks at once stays within the blocks a split's read hands them (val: 2)
    assert not [w for w in caught if "maximum number of concurrent tasks" in str(w.message)]
    for gpu_images, cpu_images in zip(on_gpu, on_cpu, strict=True):
        assert gpu_images.keys() == cpu_images.keys() and len(gpu_images) in (len(tree.train), len(tree.val))
        assert all(np.array_equal(gpu_images[k], cpu_images[k]) for k in cpu_images)
    assert not all(np.array_equal(on_gpu[0][k], on_gpu[2][k]) for k in on_gpu[0])  # epochs differ


def test_a_task_process_keeps_its_pipeline_for_one_device_at_a_time(monkeypatch):
    """Moved to another GPU of its node, a task's process drops the pipelines it built for
    the others (their cached GPU memory goes back); those for its device stay."""
    import contextlib

    import torch

    from training.stream import stage

    emptied = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(emptied.append(str(d))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    on = {d: SimpleNamespace(device=torch.device(d)) for d in ("cpu", "cuda:0", "cuda:1")}
    stages = {"train cuda:0": on["cuda:0"], "val cuda:0": on["cuda:0"], "train cuda:1": on["cuda:1"], "cpu": on["cpu"]}
    monkeypatch.setattr(stage, "STAGES", dict(stages))
    stage.drop_other_devices("cuda:0")
    assert stage.STAGES == {"train cuda:0": on["cuda:0"], "val cuda:0": on["cuda:0"]} and emptied == ["cuda:1"]
    stage.drop_other_devices("cpu")
    assert stage.STAGES == {} and emptied == ["cuda:1", "cuda:0", "cuda:0"]
