"""The Format table and the data stage over it: every storage style has a row, the neural-operator formats take
their published splits, their files are found in a folder, from one named file or over HTTPS, and the cache
holds the samples each split takes."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest

from tests.http_server import FileServer
from train.config import TaskConfig, validate
from train.data.acquire.generate_fno import generate_fno
from train.data.acquire.generate_neuralop import generate_neuralop
from train.data.acquire.generate_pdearena import generate_pdearena
from train.data.acquire.sources import DEMO_GENERATORS, stage_data
from train.data.cache.build import build_cache
from train.data.formats import FORMATS, counted_ranges, format_of, open_reader
from train.errors import DataError
from train.pdes import LAYOUTS, STYLES

REPO = Path(__file__).resolve().parents[2]


def test_every_style_has_a_row_a_page_and_every_family_a_style():
    assert set(FORMATS) == set(STYLES)
    assert {layout.style for layout in LAYOUTS.values()} == set(STYLES)
    for style, fmt in FORMATS.items():
        assert (REPO / fmt.docs).is_file(), (style, fmt.docs)
    assert set(DEMO_GENERATORS) == {s for s in STYLES if s not in ("single", "groups")}  # PDEBench: generate.py


@pytest.mark.parametrize(
    ("pde", "n", "carve_test", "expected"),
    [
        # the FNO paper's Burgers: 2048 samples, train the first 1000, test the last 100, val between them
        ("fno_burgers", 2048, True, {"train": range(0, 1000), "val": range(1000, 1100), "test": range(1948, 2048)}),
        # Darcy: 1024 in the train file, its test split a file of its own; val the 24 the reference leaves unused
        ("fno_darcy", 1024, False, {"train": range(0, 1000), "val": range(1000, 1024), "test": range(1024, 1024)}),
        # no unused sample for val: taken from the end of train
        ("fno_ns", 1200, True, {"train": range(0, 900), "val": range(900, 1000), "test": range(1000, 1200)}),
    ],
)
def test_the_published_splits_are_the_defaults(pde, n, carve_test, expected):
    task = TaskConfig(pde=pde, source="x")
    ranges = format_of(pde).ranges(task, n, True, carve_test)
    assert {k: ranges[k] for k in expected} == expected
    assert format_of(pde).own_range(task, "test", 1024) == range(0, task.files.n_test)  # a test file's first n


def test_published_sub_sampling_and_windows_are_defaults_a_task_overrides():
    assert TaskConfig(pde="fno_darcy").spatial_stride == 5
    assert TaskConfig(pde="fno_burgers").spatial_stride == 8
    assert TaskConfig(pde="fno_ns").initial_step == 10
    assert TaskConfig(pde="fno_darcy", spatial_stride=1).spatial_stride == 1
    assert TaskConfig(pde="neuralop_darcy", files={"resolution": 32}).files.resolution == 32
    with pytest.raises(ValueError, match="'files' settings are for the neural-operator families"):
        TaskConfig(pde="darcy2d", files={})


def test_too_few_samples_for_the_splits_name_the_settings():
    with pytest.raises(DataError, match=r"files\.n_test"):
        counted_ranges(TaskConfig(pde="fno_burgers"), 100, True, True)


def _stage(tmp_path, tasks: dict) -> dict:
    cfg = validate({"tasks": tasks, "run": {"data_dir": str(tmp_path / "data")}}, "test")
    return cfg, stage_data(cfg)


def test_a_named_mat_file_is_the_train_file_and_the_test_file_is_found_beside_it(tmp_path):
    folder = tmp_path / "fno"
    generate_fno(folder, "fno_darcy", 14, 17, 0)
    source = str(folder / "piececonst_r421_N1024_smooth1.mat")
    task = {"pde": "fno_darcy", "source": source, "spatial_stride": 2, "files": {"n_train": 10, "n_test": 3}}
    cfg, files = _stage(tmp_path, {"darcy": task})
    darcy = files["darcy"]
    assert darcy.train == Path(source) and darcy.test == folder / "piececonst_r421_N1024_smooth2.mat"
    assert darcy.val is None and darcy.provenance.origins["val"]["origin"] == "carved"
    assert darcy.provenance.warnings == ()  # no val file is the convention: nothing to warn about
    info = build_cache("darcy", cfg.tasks["darcy"], darcy, tmp_path / "cache")
    assert info.sizes == {"train": 10, "val": 1, "test": 3} and info.grid == (9, 9)
    reader = open_reader(darcy.test, cfg.tasks["darcy"])
    (first,) = reader.parts(range(0, 3))
    physical = info.array("test", "y") * np.float32(info.target_std) + np.float32(info.target_mean)
    np.testing.assert_allclose(physical, first["y"], rtol=1e-5, atol=1e-6)  # the test file's first n_test


def test_formats_are_found_and_downloaded_over_https_under_their_own_names(tmp_path):
    www = tmp_path / "www"
    generate_neuralop(www / "op", "neuralop_darcy", 12, 16, 0)
    generate_pdearena(www / "arena", 12, 16, 0)
    with FileServer(www) as server:
        tasks = {
            "darcy": {"pde": "neuralop_darcy", "source": f"{server.url}/op"},
            "smoke": {"pde": "pdearena_ns", "source": f"{server.url}/arena"},
        }
        _, files = _stage(tmp_path, tasks)
    data = tmp_path / "data"
    assert files["darcy"].train == data / "darcy" / "darcy_train_16.pt"
    assert files["darcy"].test.read_bytes() == (www / "op" / "darcy_test_16.pt").read_bytes()
    assert [p.name for p in files["smoke"].paths("val")] == [p.name for p in (www / "arena").glob("*valid*.h5")]
    origin = files["smoke"].provenance.origins["train"]
    assert origin["origin"] == "https" and len(origin["files"]) == 1


def test_float32_pt_tensors_are_mapped_in_place_and_read_as_a_copy_would(tmp_path):
    """neuraloperator's NS fields (contiguous float32) are the cache's own bytes: mapped where they lie in the zip
    members; Darcy's bool inputs are copied. Either way the cache reads what the reader gives."""
    for pde in ("neuralop_ns", "neuralop_darcy"):
        train, _ = generate_neuralop(tmp_path / pde, pde, 9, 8, 0)
        task = TaskConfig(pde=pde, source=str(tmp_path / pde), files={"resolution": 8})
        from train.data.acquire.sources import SplitFiles

        info = build_cache(pde, task, SplitFiles(train=train), tmp_path / "cache")
        assert (info.in_place is not None) == (pde == "neuralop_ns"), pde
        (whole,) = list(open_reader(train, task).parts(range(0, 9)))
        samples = info.splits["train"]["samples"]
        mean, std = np.float32(info.target_mean), np.float32(info.target_std)
        expected = whole["y"][samples[0] : samples[1]]
        np.testing.assert_allclose(info.array("train", "y")[:] * std + mean, expected, rtol=1e-5, atol=1e-5)


def test_a_demo_dataset_is_generated_once_for_its_settings_and_replaced_whole(tmp_path):
    """A repeated or resumed run finds the same files (not rewritten); other settings leave no file of the old
    ones to be found beside the new (PDEArena's train file is named by its sample count)."""
    task = {"pde": "pdearena_ns", "n_samples": 10, "resolution": 8}
    _, first = _stage(tmp_path, {"smoke": task})
    (train,) = first["smoke"].paths("train")
    stamp = train.stat().st_mtime_ns
    _, again = _stage(tmp_path, {"smoke": task})
    assert again["smoke"].paths("train") == [train] and train.stat().st_mtime_ns == stamp
    _, other = _stage(tmp_path, {"smoke": {**task, "n_samples": 20}})
    (bigger,) = other["smoke"].paths("train")
    assert bigger != train and not train.exists()


def test_the_disk_plan_counts_a_folder_of_pt_files_as_copied():
    """Whether a .pt folder maps in place is known only once its files are read: the plan counts the copy."""
    from train.launch.capacity import cache_bytes

    assert cache_bytes(TaskConfig(pde="neuralop_darcy", files={"resolution": 16}), None, 1000) == 1000


def test_a_published_archive_is_downloaded_unpacked_once_and_read(tmp_path):
    """neuraloperator's {name}_{res}.tgz in place of its .pt files, over HTTPS."""
    made = generate_neuralop(tmp_path / "made", "neuralop_darcy", 12, 16, 0)
    (tmp_path / "www").mkdir()
    with tarfile.open(tmp_path / "www" / "darcy_16.tgz", "w:gz") as tar:
        for path in made:
            tar.add(path, arcname=path.name)
    with FileServer(tmp_path / "www") as server:
        _, files = _stage(tmp_path, {"darcy": {"pde": "neuralop_darcy", "source": server.url}})
        unpacked = tmp_path / "data" / "darcy" / "darcy_16"
        assert (files["darcy"].train, files["darcy"].test) == (unpacked / made[0].name, unpacked / made[1].name)
        assert files["darcy"].test.read_bytes() == made[1].read_bytes()
        _, again = _stage(tmp_path, {"darcy": {"pde": "neuralop_darcy", "source": server.url}})
        assert again["darcy"].train == files["darcy"].train
        assert server.requests["darcy_16.tgz"] == 1  # the second run found the download and the files


def test_a_folder_without_the_train_file_names_what_was_looked_for(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"(?s)burgers_data_R10\.mat.*docs/fno-mat\.md"):
        _stage(tmp_path, {"b": {"pde": "fno_burgers", "source": str(tmp_path / "empty")}})


GENERATED = {
    "fno_darcy": lambda folder: generate_fno(folder, "fno_darcy", 5, 9, 0)[1],  # MATLAB v5
    "fno_ns": lambda folder: generate_fno(folder, "fno_ns", 4, 8, 0, n_frames=5)[0],  # MATLAB v7.3
    "neuralop_darcy": lambda folder: generate_neuralop(folder, "neuralop_darcy", 5, 8, 0)[1],
    "neuralop_burgers": lambda folder: generate_neuralop(folder, "neuralop_burgers", 5, 8, 0)[0],
    "pdearena_ns": lambda folder: generate_pdearena(folder, 5, 8, 0, n_frames=4)[2],
}


@pytest.mark.parametrize("pde", sorted(GENERATED))
def test_predictions_are_written_back_in_the_input_format(tmp_path, pde):
    """What predict writes (Format.write_back) reads back through the format's own reader as what was given."""
    source = GENERATED[pde](tmp_path / "in")
    task = TaskConfig(pde=pde, initial_step=1, spatial_stride=1)
    reader = open_reader(source, task)
    (parts,) = list(reader.parts(range(reader.n_samples)))
    inputs = parts.get("x", parts.get(""))
    outputs = 2 * (parts["y"] if "y" in parts else parts[""])
    out = tmp_path / f"pred{source.suffix}"
    format_of(pde).write_back(out, reader, inputs, outputs)
    (back,) = list(open_reader(out, task).parts(range(reader.n_samples)))
    np.testing.assert_allclose(back["y"] if "y" in back else back[""], outputs, rtol=1e-6)
    if "x" in back:
        np.testing.assert_allclose(back["x"], inputs, rtol=1e-6)


def test_predict_refuses_only_the_well_and_names_what_to_use():
    assert [style for style, fmt in FORMATS.items() if fmt.predicts] == ["well"]
    assert "Surrogate" in FORMATS["well"].predicts
    assert all(fmt.write_back for style, fmt in FORMATS.items() if style not in ("single", "groups", "well"))
