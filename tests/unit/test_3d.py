"""3D PDEBench: the 3D CFD layout, its generator, its cache, and the FNO and U-Net in 3D."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from train.config import FNOConfig, TaskConfig, UNetConfig
from train.data.acquire.generate_cfd import cfd_fields, write_cfd
from train.data.cache.build import build_cache
from train.data.formats import open_reader
from train.model.fno import FNO, SpectralConv
from train.model.specs import TaskSpec
from train.model.unet import UNet

GRID = (10, 8, 12)  # each axis above twice the largest wavenumber generated (3): no aliasing


@pytest.fixture(scope="module")
def cfd3d(tmp_path_factory):
    return write_cfd(tmp_path_factory.mktemp("cfd3d") / "3D_CFD_Rand_periodic_Train.hdf5", 10, 5, GRID)


def test_the_generated_file_has_pdebench_3d_cfd_layout(cfd3d):
    with h5py.File(cfd3d) as f:
        assert sorted(f) == sorted([*cfd_fields(3), "x-coordinate", "y-coordinate", "z-coordinate", "t-coordinate"])
        for key in cfd_fields(3):
            assert f[key].shape == (10, 5, *GRID) and f[key].dtype == np.float32 and f[key].chunks is None
        assert f["t-coordinate"].shape == (6,)  # one entry more than the time axis, as PDEBench's files
        np.testing.assert_allclose(f["z-coordinate"][:], (np.arange(12) + 0.5) / 12)
        rho, vx, vy, vz = (f[k][3] for k in ("density", "Vx", "Vy", "Vz"))
        t = f["t-coordinate"][:5]
    # An exact Euler solution: the density is carried by the uniform flow, rho(x, t) = rho(x - v t, 0), so each
    # Fourier mode turns by exp(-2 pi i k.v t) (the plane waves have whole wavenumbers: exact on the grid).
    assert np.ptp(vx) == np.ptp(vy) == np.ptp(vz) == 0
    assert not np.allclose(rho[0], rho[-1])
    v = np.array([vx.flat[0], vy.flat[0], vz.flat[0]], np.float64)
    k = np.meshgrid(*[np.fft.fftfreq(n, 1 / n) for n in GRID], indexing="ij")
    first = np.fft.fftn(rho[0].astype(np.float64))
    for frame in range(1, 5):
        turned = first * np.exp(-2j * np.pi * sum(v[a] * k[a] for a in range(3)) * t[frame])
        np.testing.assert_allclose(np.real(np.fft.ifftn(turned)), rho[frame], atol=1e-5)


def test_a_3d_cfd_file_is_read_and_cached_in_place_with_five_channels(cfd3d, tmp_path):
    task = TaskConfig(pde="cfd3d", test_fraction=0.2, val_fraction=0.1)
    reader = open_reader(cfd3d, task)
    assert (reader.n_samples, reader.grid, reader.n_frames) == (10, GRID, 5)
    info = build_cache("cfd3d", task, cfd3d, tmp_path / "cache")
    assert info.array("train").in_place and info.in_channels == info.out_channels == 5
    assert info.array("train").shape == (7, 5, *GRID, 5) and info.grid == GRID
    with h5py.File(cfd3d) as f:
        raw = np.stack([f[k][:] for k in cfd_fields(3)], axis=-1)
    np.testing.assert_array_equal(info.array("test").raw(), raw[:2])  # test first, as PDEBench's single files
    train = raw[3:].astype(np.float64)
    np.testing.assert_allclose(info.input_mean, train.mean((0, 1, 2, 3, 4)), rtol=1e-6, atol=1e-7)
    strided = build_cache("cfd3d", task.model_copy(update={"spatial_stride": 2}), cfd3d, tmp_path / "cache")
    assert not strided.array("train").in_place and strided.grid == (5, 4, 6)
    np.testing.assert_array_equal(strided.array("train").raw(), raw[3:, :, ::2, ::2, ::2])


def test_the_3d_spectral_layer_is_pdebench_spectralconv3d():
    """Four blocks of weights: low/high frequencies along x and y, the lowest along z (PDEBench's weights1..4)."""
    torch.manual_seed(0)
    modes = (3, 2, 2)
    layer = SpectralConv(4, modes)
    x = torch.randn(2, 4, 8, 6, 5)
    w = torch.view_as_complex(layer.weights.detach())
    spectrum = torch.fft.rfftn(x, dim=(2, 3, 4))
    out = torch.zeros_like(spectrum)
    m1, m2, m3 = modes
    for block, (sx, sy) in enumerate(
        [(slice(None, m1), slice(None, m2)), (slice(-m1, None), slice(None, m2)),
         (slice(None, m1), slice(-m2, None)), (slice(-m1, None), slice(-m2, None))]
    ):  # fmt: skip
        out[:, :, sx, sy, :m3] = torch.einsum("bixyz,ioxyz->boxyz", spectrum[:, :, sx, sy, :m3], w[block])
    expected = torch.fft.irfftn(out, s=(8, 6, 5), dim=(2, 3, 4))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("model", "cfg"), [(FNO, FNOConfig(modes=3, width=8)), (UNet, UNetConfig(init_features=4))])
def test_3d_models_map_frames_to_the_next_frame_and_learn(model, cfg):
    torch.manual_seed(0)
    spec = TaskSpec(GRID, 5, 5, 4, 2, True)
    net = model(spec, cfg)
    x = torch.randn(3, 2, *GRID, 5)
    target = 0.5 * x[:, -1] - 0.25 * x[:, 0]  # a map of the frames both models can represent
    optimizer = torch.optim.Adam(net.parameters(), 1e-2)
    losses = []
    for _ in range(15):
        loss = torch.nn.functional.mse_loss(net(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert net(x).shape == (3, *GRID, 5)
    assert losses[-1] < 0.7 * losses[0], losses
