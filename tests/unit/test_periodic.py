"""Periodic axes reach the models: from the family's published boundary conditions, a task's own setting or the
file's record; the FNO's coordinates leave out a periodic axis's duplicated end point."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from train.config import FNOConfig, TaskConfig
from train.data.cache.info import CacheInfo
from train.errors import ConfigError, DataError
from train.model.fno import FNO
from train.model.specs import task_spec
from train.pdes import PERIODIC


def _info(pde: str, grid: tuple[int, ...], boundary: tuple = ()) -> CacheInfo:
    return CacheInfo(
        Path("/data/cache"), pde, True, grid, 9, 1, 1, {}, (0.0,), (1.0,), (0.0,), (1.0,), {}, boundary=boundary
    )


@pytest.mark.parametrize(
    ("pde", "grid", "periodic"),
    [
        ("advection1d", (32,), (True,)),
        ("burgers1d", (32,), (True,)),
        ("cfd2d", (8, 8), (True, True)),
        ("diffsorp1d", (32,), (False,)),
        ("shallowwater2d", (8, 8), (False, False)),
    ],
)
def test_a_familys_published_boundary_conditions_reach_the_spec(pde, grid, periodic):
    task = TaskConfig(pde=pde, patch_size=4)
    assert task_spec(_info(pde, grid), task, "t").periodic == periodic


def test_a_tasks_setting_decides_where_the_data_says_nothing_and_must_agree_where_it_does():
    adv, darcy = _info("advection1d", (32,)), _info("darcy2d", (8, 8))
    assert task_spec(adv, TaskConfig(pde="advection1d", periodic=False), "a").periodic == (False,)
    assert task_spec(darcy, TaskConfig(pde="darcy2d", periodic=[True, False]), "d").periodic == (True, False)
    with pytest.raises(ConfigError, match=r"tasks\.d\.periodic has 1 flag\(s\), the data has 2 spatial axes"):
        task_spec(darcy, TaskConfig(pde="darcy2d", periodic=[True]), "d")
    recorded = replace(darcy, boundary=((PERIODIC, PERIODIC), (0, 0)))  # a file's own record
    assert task_spec(recorded, TaskConfig(pde="darcy2d", periodic=[True, False]), "d").periodic == (True, False)
    with pytest.raises(DataError, match=r"tasks\.d\.periodic=\[True, True\] contradicts the data \(/data/cache"):
        task_spec(recorded, TaskConfig(pde="darcy2d", periodic=True), "d")


def test_the_fnos_coordinates_leave_out_the_end_point_of_a_periodic_axis_only():
    for periodic, last in ((True, 31 / 32), (False, 1.0)):
        spec = task_spec(_info("advection1d", (32,)), TaskConfig(pde="advection1d", periodic=periodic), "a")
        x = FNO(spec, FNOConfig(modes=4, width=4, layers=1))._coordinates(torch.zeros(2, 32, 1))
        assert x.shape == (2, 32, 1) and x[0, 0, 0] == 0 and x[0, -1, 0].item() == pytest.approx(last)
        assert torch.allclose(x[0, 1:, 0] - x[0, :-1, 0], torch.full((31,), 1 / (32 if periodic else 31)))


def test_a_pdebench_familys_periodic_axis_reaches_the_unet_and_the_fno_and_darcys_walls_do_not():
    from train.config import UNetConfig
    from train.model.unet import UNet

    adv = task_spec(_info("advection1d", (32,)), TaskConfig(pde="advection1d"), "a")
    darcy = task_spec(_info("darcy2d", (16, 16)), TaskConfig(pde="darcy2d"), "d")
    wraps = lambda model: any(type(m).__name__ == "WrappingConv" for m in model.modules())  # noqa: E731
    assert wraps(UNet(adv, UNetConfig(init_features=4))) and not wraps(UNet(darcy, UNetConfig(init_features=4)))
    assert FNO(adv, FNOConfig(modes=4, width=4)).pads == [0] and FNO(darcy, FNOConfig(modes=4, width=4)).pads == [2, 2]
