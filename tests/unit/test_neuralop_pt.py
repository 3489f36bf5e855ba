"""neuraloperator's ``.pt`` files, read as neuraloperator's own PTDataset reads them (a test-only dependency), and
every malformed or unsafe file refused with its name and key."""

from __future__ import annotations

import io
import pathlib
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from train.config import TaskConfig
from train.data.acquire.generate_neuralop import generate_neuralop
from train.data.formats.neuralop_pt import (
    NAMES,
    NeuralopPtReader,
    locate_neuralop_pt,
    open_neuralop_pt,
    unpack_archive,
    write_pt,
)
from train.errors import DataError
from train.stores.local import LocalStore

pt_dataset = pytest.importorskip(
    "neuralop.data.datasets.pt_dataset", reason="neuraloperator is a test-only dependency: pip install '.[dev]'"
)


def _task(pde: str, **settings) -> TaskConfig:
    return TaskConfig.model_validate({"pde": pde, "source": "x", **settings})


def _ours(reader: NeuralopPtReader, samples: range | None = None) -> dict[str, np.ndarray]:
    blocks = list(reader.parts(samples or range(reader.n_samples)))
    return {key: np.concatenate([b[key] for b in blocks]) for key in blocks[0]}


def _theirs(root: Path, pde: str, n: int, res: int):
    """neuraloperator's PTDataset over the files, normalisation off: (train x, train y, test x, test y).

    Its sub-sampling is left off: with squeezed channels it counts one spatial axis too few (it takes the
    axes from the stored tensor, which has no channel axis), so it would stride only the first axis. The
    tests stride its full-resolution tensors instead.
    """
    data = pt_dataset.PTDataset(
        root_dir=root,
        dataset_name=NAMES[pde],
        n_train=n,
        n_tests=[n],
        batch_size=4,
        test_batch_sizes=[4],
        train_resolution=res,
        test_resolutions=[res],
        encode_input=False,
        encode_output=False,
    )
    train, test = data.train_db, data.test_dbs[res]
    return train.x, train.y, test.x, test.y


@pytest.mark.parametrize(("pde", "res", "stride"), [("neuralop_darcy", 16, 1), ("neuralop_ns", 32, 2)])
def test_steady_pairs_match_ptdataset(tmp_path, pde, res, stride):
    train_file, test_file = generate_neuralop(tmp_path, pde, 12, res, seed=3, n_test=6)
    assert [p.name for p in (train_file, test_file)] == [f"{NAMES[pde]}_{s}_{res}.pt" for s in ("train", "test")]
    task = _task(pde, spatial_stride=stride, files={"resolution": res})
    x_tr, y_tr, x_te, y_te = _theirs(tmp_path, pde, 6, res)
    for path, x, y in ((train_file, x_tr, y_tr), (test_file, x_te, y_te)):
        reader = open_neuralop_pt([path], task)
        ours = _ours(reader, range(6))
        assert reader.grid == (len(range(0, res, stride)),) * 2 and reader.n_frames == 1
        assert ours["x"].dtype == ours["y"].dtype == np.float32
        # Theirs is channels-first (n, 1, *grid), ours channels-last (n, *grid, 1).
        np.testing.assert_array_equal(ours["x"][..., 0], x[:, 0, ::stride, ::stride].numpy())
        np.testing.assert_array_equal(ours["y"][..., 0], y[:, 0, ::stride, ::stride].numpy().astype(np.float32))


def test_darcy_layout_bool_and_non_contiguous(tmp_path):
    train_file, _ = generate_neuralop(tmp_path, "neuralop_darcy", 12, 16, seed=0)
    data = torch.load(train_file, weights_only=True)
    assert set(data) == {"x", "y"}
    assert data["x"].dtype == torch.bool and data["y"].dtype == torch.float32
    assert data["x"].shape == data["y"].shape == (12, 16, 16)
    assert not data["x"].is_contiguous() and data["x"].stride() == (1, 12, 12 * 16)
    ours = _ours(NeuralopPtReader(train_file, "neuralop_darcy"))
    np.testing.assert_array_equal(ours["x"][..., 0], data["x"].numpy().astype(np.float32))
    np.testing.assert_array_equal(ours["y"][..., 0], data["y"].numpy())
    assert 0 < ours["x"].mean() < 1 and (ours["y"] > 0).all()


def test_non_contiguous_float_tensors(tmp_path):
    x = torch.randn(5, 8, 8)
    y = torch.randn(8, 8, 5).permute(2, 0, 1)  # strides (1, 40, 5)
    write_pt(tmp_path / "ns.pt", {"x": x.transpose(1, 2), "y": y})
    ours = _ours(NeuralopPtReader(tmp_path / "ns.pt", "neuralop_ns", spatial_stride=3))
    np.testing.assert_array_equal(ours["x"][..., 0], x.transpose(1, 2)[:, ::3, ::3].numpy())
    np.testing.assert_array_equal(ours["y"][..., 0], y[:, ::3, ::3].numpy())


def test_burgers_trajectory_matches_ptdataset(tmp_path):
    train_file, _ = generate_neuralop(tmp_path, "neuralop_burgers", 12, 16, seed=1, n_test=4)
    data = torch.load(train_file, weights_only=True)
    assert data["x"].dtype == data["y"].dtype == torch.float64
    assert data["x"].shape == (12, 16) and data["y"].shape == (12, 17, 16)
    assert torch.equal(data["y"][:, 0], data["x"]) and data["visc"].shape == (1, 1)
    reader = open_neuralop_pt([train_file], _task("neuralop_burgers", spatial_stride=2))
    assert (reader.n_samples, reader.n_frames, reader.grid) == (12, 17, (8,))
    ours = _ours(reader, range(1, 9))
    assert set(ours) == {""} and ours[""].shape == (8, 17, 8, 1) and ours[""].dtype == np.float32
    _, y, _, _ = _theirs(tmp_path, "neuralop_burgers", 9, 16)
    assert y.dtype == torch.float64  # PTDataset keeps y's stored dtype
    np.testing.assert_array_equal(ours[""][..., 0], y[1:9, 0, :, ::2].numpy().astype(np.float32))


def test_legacy_format_reads_without_mmap(tmp_path):
    x, y = torch.rand(4, 8, 8), torch.rand(4, 8, 8)
    torch.save({"x": x, "y": y}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    ours = _ours(NeuralopPtReader(tmp_path / "old.pt", "neuralop_ns"))
    np.testing.assert_array_equal(ours["y"][..., 0], y.numpy())


class _Touch:
    """Pickles as a call that creates a file: what a file holding code would run when loaded unsafely."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


class _Shell:
    """Pickles as a shell command that creates a file: the pinned torch words its refusal of a blocked module
    ("unsupported GLOBAL posix.system whose module posix is blocked") otherwise than of an unknown global."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("code", [_Touch, _Shell])
def test_pickled_code_is_refused_not_run(tmp_path, legacy, code):
    marker = tmp_path / "marker"
    path = tmp_path / "darcy_train_16.pt"
    torch.save({"x": code(marker), "y": torch.zeros(2, 4, 4)}, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(DataError, match=r"darcy_train_16\.pt.*refused, never executed.*torch\.save"):
        NeuralopPtReader(path, "neuralop_darcy")
    assert not marker.exists()


def test_a_storage_record_shorter_than_its_pickle_says_is_refused_not_read_past(tmp_path):
    """The memory-mapped load takes a record's length from the pickle: a record cut short was read on into the
    next one (1,517 of 3,042 cached values from the next member, exit 0) where the plain load refuses the file."""
    import zipfile

    x, y = torch.rand(6, 8, 8), torch.rand(6, 8, 8)
    good = write_pt(tmp_path / "good.pt", {"x": x, "y": y})
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(tmp_path / "short.pt", "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info.filename)
            out.writestr(info, data[: len(data) // 2] if info.filename.endswith("data/0") else data)
    assert torch.load(tmp_path / "short.pt", weights_only=True, mmap=True)["x"].shape == x.shape  # torch maps it
    with pytest.raises(
        DataError, match=r"short\.pt: 'x' needs 1536 bytes of storage record \S+/data/0, which holds 768"
    ):
        NeuralopPtReader(tmp_path / "short.pt", "neuralop_ns")
    ours = _ours(NeuralopPtReader(good, "neuralop_ns"))
    np.testing.assert_array_equal(ours["x"][..., 0], x.numpy())


@pytest.mark.parametrize(
    ("tensors", "pde", "match"),
    [
        ({"x": torch.zeros(2, 4, 4)}, "neuralop_darcy", r"key 'y' not found \(keys: \['x'\]\)"),
        ({"x": torch.zeros(2, 4, 4), "y": [1.0]}, "neuralop_ns", r"'y' is a list, not a tensor"),
        ({"x": torch.zeros(2, 4, 4), "y": torch.zeros(2, 1, 4, 4)}, "neuralop_darcy", r"'y' has shape \(2, 1, 4, 4\)"),
        ({"x": torch.zeros(2, 4), "y": torch.zeros(2, 3, 4, 4)}, "neuralop_burgers", r"'y' has shape \(2, 3, 4, 4\)"),
        ({"x": torch.zeros(3, 4, 4), "y": torch.zeros(2, 4, 4)}, "neuralop_ns", r"'x' holds 3 samples but 'y' 2"),
        ({"x": torch.zeros(3, 4), "y": torch.zeros(2, 5, 4)}, "neuralop_burgers", r"'x' holds 3 samples but 'y' 2"),
        ({"x": torch.zeros(2, 4, 4, dtype=torch.bool), "y": torch.zeros(2, 4, 4)}, "neuralop_ns", r"'x' has dtype"),
        ({"x": torch.zeros(2, 4, 4), "y": torch.zeros(2, 8, 8)}, "neuralop_ns", r"'x' grid \(4, 4\) differs"),
    ],
)
def test_malformed_files_name_file_and_key(tmp_path, tensors, pde, match):
    path = write_pt(tmp_path / "bad.pt", tensors)
    with pytest.raises(DataError, match=r"bad\.pt: " + match):
        NeuralopPtReader(path, pde)


def test_unreadable_files(tmp_path):
    good = write_pt(tmp_path / "good.pt", {"x": torch.zeros(2, 4, 4), "y": torch.zeros(2, 4, 4)})
    blob = good.read_bytes()
    (tmp_path / "cut.pt").write_bytes(blob[: len(blob) // 2])
    (tmp_path / "text.pt").write_text("not a tensor file\n")
    for name in ("cut.pt", "text.pt"):
        with pytest.raises(DataError, match=rf"{name}: not a readable torch.save file"):
            NeuralopPtReader(tmp_path / name, "neuralop_ns")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(DataError, match=r"list\.pt: holds a list, not a dict"):
        NeuralopPtReader(tmp_path / "list.pt", "neuralop_ns")
    with pytest.raises(DataError, match="not found"):
        NeuralopPtReader(tmp_path / "absent.pt", "neuralop_ns")
    with pytest.raises(DataError, match="spatial stride 8 exceeds"):
        NeuralopPtReader(good, "neuralop_ns", spatial_stride=8)
    with pytest.raises(DataError, match=r"one \.pt file, got 2"):
        open_neuralop_pt([good, good], _task("neuralop_ns"))
    write_pt(tmp_path / "nan.pt", {"x": torch.zeros(2, 4, 4), "y": torch.full((2, 4, 4), float("nan"))})
    with pytest.raises(DataError, match=r"nan\.pt: non-finite values .* in 'y' at sample 0"):
        _ours(NeuralopPtReader(tmp_path / "nan.pt", "neuralop_ns"))


def test_reader_pickles_before_and_after_use(tmp_path):
    train_file, _ = generate_neuralop(tmp_path, "neuralop_ns", 12, 16, seed=0)
    reader = NeuralopPtReader(train_file, "neuralop_ns", spatial_stride=2)
    before = pickle.loads(pickle.dumps(reader))
    expected = _ours(reader)
    after = pickle.loads(pickle.dumps(reader))
    for copy in (before, after):
        assert copy._data is None and (copy.n_samples, copy.grid) == (12, (8, 8))
        got = _ours(copy)
        np.testing.assert_array_equal(got["x"], expected["x"])
        np.testing.assert_array_equal(got["y"], expected["y"])
    assert reader.describe() == {"channels": ["w"]} and reader.coordinates() == {}
    reader.close()
    assert reader._data is None


def test_locate_in_a_store(tmp_path):
    generate_neuralop(tmp_path, "neuralop_darcy", 12, 16, seed=0, n_test=3)
    store = LocalStore(tmp_path)
    task = _task("neuralop_darcy")
    assert locate_neuralop_pt(store, task, "train") == ["darcy_train_16.pt"]
    assert locate_neuralop_pt(store, task, "test") == ["darcy_test_16.pt"]
    assert locate_neuralop_pt(store, task, "val") == []
    assert locate_neuralop_pt(store, _task("neuralop_darcy", files={"resolution": 32}), "train") == []
    assert locate_neuralop_pt(store, _task("neuralop_ns"), "train") == []
    named = _task("neuralop_darcy", files={"train_file": "darcy_test_16.pt", "test_file": "nope.pt"})
    assert locate_neuralop_pt(store, named, "train") == ["darcy_test_16.pt"]
    assert locate_neuralop_pt(store, named, "test") == []


def _tar(path: Path, members: dict[str, bytes], link: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return path


def test_unpack_archive(tmp_path):
    src = tmp_path / "src"
    train_file, test_file = generate_neuralop(src, "neuralop_darcy", 12, 16, seed=0, n_test=3)
    archive = _tar(
        tmp_path / "darcy_16.tgz", {p.name: p.read_bytes() for p in (train_file, test_file)} | {"README.txt": b"notes"}
    )
    dest = tmp_path / "data"
    out = unpack_archive(archive, dest)
    assert sorted(p.name for p in out) == ["darcy_test_16.pt", "darcy_train_16.pt"]
    assert sorted(p.name for p in dest.iterdir()) == ["darcy_test_16.pt", "darcy_train_16.pt"]
    assert (dest / "darcy_train_16.pt").read_bytes() == train_file.read_bytes()
    assert NeuralopPtReader(dest / "darcy_test_16.pt", "neuralop_darcy").n_samples == 3


@pytest.mark.parametrize(
    ("members", "link", "match"),
    [
        ({"darcy_train_16.pt": b"x", "../evil.pt": b"x"}, None, r"refusing member '\.\./evil\.pt'"),
        ({"/abs/evil.pt": b"x"}, None, r"refusing member '/abs/evil\.pt'"),
        ({"darcy_train_16.pt": b"x"}, "darcy_test_16.pt", r"refusing member 'darcy_test_16\.pt': a link"),
    ],
)
def test_unpack_archive_refuses_unsafe_members(tmp_path, members, link, match):
    archive = _tar(tmp_path / "darcy_16.tgz", members, link)
    dest = tmp_path / "inner" / "data"
    with pytest.raises(DataError, match=r"darcy_16\.tgz: " + match):
        unpack_archive(archive, dest)
    assert not (tmp_path / "inner" / "evil.pt").exists() and not dest.exists()


def test_unpack_archive_refuses_a_damaged_archive(tmp_path):
    archive = _tar(tmp_path / "darcy_16.tgz", {"darcy_train_16.pt": bytes(range(256)) * 4096})
    archive.write_bytes(archive.read_bytes()[:-200])
    with pytest.raises(DataError, match=r"darcy_16\.tgz: not a readable tar archive"):
        unpack_archive(archive, tmp_path / "data")
    assert not list(tmp_path.rglob("data/*.pt"))
