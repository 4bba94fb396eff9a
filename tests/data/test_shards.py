"""Tensor shard folders: round trips per format, stats, every bad-input message, factories, and the RAM bound."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from surefit.data.shards import GB, TensorData, load_tensor_data
from surefit.errors import DataError

ORDER = [5, 0, 7, 8, 9]
N = 11


def _source() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "inputs_embeds": rng.standard_normal((N, 4, 3)).astype(np.float32),
        "labels": rng.integers(0, 5, N).astype(np.int64),
        "mask": rng.random((N, 4)) > 0.5,
    }


def _assert_rows(batch: dict[str, torch.Tensor], src: dict[str, np.ndarray]) -> None:
    assert set(batch) == set(src)
    for name, a in src.items():
        assert batch[name].shape == (len(ORDER), *a.shape[1:])
        assert batch[name].dtype == torch.from_numpy(a).dtype
        assert np.array_equal(batch[name].numpy(), a[ORDER]), name


def _problems(excinfo: pytest.ExceptionInfo) -> list[str]:
    return [p.render() for p in excinfo.value.problems]


def _one(problems: list[str], *parts: str) -> str:
    """The single problem containing every part."""
    hits = [p for p in problems if all(part in p for part in parts)]
    assert len(hits) == 1, (parts, problems)
    return hits[0]


# ---------------------------------------------------------------------------------------------------------------------
# round trips


def test_npy_shards_round_trip(tmp_path):
    src = _source()
    x = src["inputs_embeds"]
    # Unpadded numbers: shard 2 must come before shard 10.
    np.save(tmp_path / "inputs_embeds-2.npy", x[:4])
    np.save(tmp_path / "inputs_embeds-10.npy", x[4:9])
    np.save(tmp_path / "inputs_embeds-11.npy", x[9:])
    np.save(tmp_path / "labels.npy", src["labels"])
    np.save(tmp_path / "mask.npy", src["mask"])
    (tmp_path / "README.md").write_text("notes travel with the data")
    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / ".DS_Store").write_bytes(b"\0")

    td = TensorData(tmp_path)
    assert len(td) == N
    _assert_rows(td.batch(ORDER), src)
    info = td.arrays["inputs_embeds"]
    assert (info.shape, info.dtype, info.nbytes) == ((N, 4, 3), "float32", x.nbytes)
    assert [Path(f).name for f in info.files] == ["inputs_embeds-2.npy", "inputs_embeds-10.npy", "inputs_embeds-11.npy"]
    assert td.arrays["labels"].shape == (N,) and td.arrays["labels"].dtype == "int64"
    assert td.arrays["mask"].dtype == "bool"
    # A run across a shard boundary, negative indices, a tensor of indices.
    assert np.array_equal(td.batch(range(2, 10))["inputs_embeds"].numpy(), x[2:10])
    assert np.array_equal(td.batch(torch.tensor([-1, 3]))["labels"].numpy(), src["labels"][[10, 3]])
    assert td.batch([])["inputs_embeds"].shape == (0, 4, 3)
    with pytest.raises(IndexError, match="example index 11 out of range for 11 examples"):
        td.batch([0, 11])


def test_big_endian_npy_is_read_in_native_order(tmp_path):
    src = _source()
    np.save(tmp_path / "inputs_embeds.npy", src["inputs_embeds"].astype(">f4"))
    np.save(tmp_path / "labels.npy", src["labels"].astype(">i8"))
    td = TensorData(tmp_path)
    b = td.batch(ORDER)
    assert np.array_equal(b["inputs_embeds"].numpy(), src["inputs_embeds"][ORDER])
    assert b["labels"].tolist() == src["labels"][ORDER].tolist()


def test_safetensors_round_trip_with_bf16(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(N, 4, 3).to(torch.bfloat16)
    h = torch.randn(N, 2).to(torch.float16)
    labels = torch.arange(N, dtype=torch.int64) * 3
    save_file({"inputs_embeds": x[:6].contiguous(), "half": h[:6].contiguous(), "labels": labels[:6].contiguous()},
              tmp_path / "shard-00001.safetensors", metadata={"note": "first"})
    save_file({"inputs_embeds": x[6:].contiguous(), "half": h[6:].contiguous(), "labels": labels[6:].contiguous()},
              tmp_path / "shard-00002.safetensors")
    td = TensorData(tmp_path)
    assert len(td) == N and set(td.arrays) == {"inputs_embeds", "half", "labels"}
    assert td.arrays["inputs_embeds"].dtype == "bfloat16" and td.arrays["inputs_embeds"].shape == (N, 4, 3)
    b = td.batch(ORDER)
    assert b["inputs_embeds"].dtype == torch.bfloat16 and torch.equal(b["inputs_embeds"], x[ORDER])
    assert b["half"].dtype == torch.float16 and torch.equal(b["half"], h[ORDER])
    assert b["labels"].dtype == torch.int64 and b["labels"].tolist() == [15, 0, 21, 24, 27]
    assert len(TensorData(tmp_path / "shard-00001.safetensors")) == 6  # one shard file on its own is accepted


def test_npz_round_trip_plain_and_compressed(tmp_path):
    src = _source()
    np.savez(tmp_path / "part-1.npz", **{k: v[:7] for k, v in src.items()})
    np.savez_compressed(tmp_path / "part-2.npz", **{k: v[7:] for k, v in src.items()})
    td = TensorData(tmp_path, max_memory_gb=1)
    assert len(td) == N
    _assert_rows(td.batch(ORDER), src)


def test_pt_round_trip(tmp_path):
    src = _source()
    torch.save({k: torch.from_numpy(v[:3]) for k, v in src.items()}, tmp_path / "a-0.pt")
    torch.save({k: torch.from_numpy(v[3:]) for k, v in src.items()}, tmp_path / "a-1.pt")
    td = TensorData(tmp_path)
    _assert_rows(td.batch(ORDER), src)


def test_batches_are_fresh_tensors_not_views_of_the_cache(tmp_path):
    src = _source()
    np.savez(tmp_path / "only.npz", **src)
    td = TensorData(tmp_path)
    b = td.batch([0, 1])
    b["inputs_embeds"].fill_(7)
    assert np.array_equal(td.batch([0, 1])["inputs_embeds"].numpy(), src["inputs_embeds"][:2])


def test_describe_footprint_and_pickle(tmp_path):
    src = _source()
    for k, v in src.items():
        np.save(tmp_path / f"{k}.npy", v)
    td = TensorData(tmp_path)
    assert td.footprint() == sum(v.nbytes for v in src.values()) == 528 + 88 + 44
    text = td.describe()
    lines = text.splitlines()
    assert lines[0].split() == ["name", "shape", "dtype", "min..max", "NaN/inf", "footprint"]
    assert "inputs_embeds  [11, 4, 3]  float32" in text
    assert "labels" in lines[2] and "[11]" in lines[2] and "int64" in lines[2] and "88 B" in lines[2]
    lo, hi = src["labels"].min(), src["labels"].max()
    assert f"{lo}..{hi}" in lines[2]
    assert lines[-1] == "11 examples, 660 B in all"
    # DataLoader workers started by spawn get a pickled copy: it must read the same rows.
    copy = pickle.loads(pickle.dumps(td))
    _assert_rows(copy.batch(ORDER), src)


# ---------------------------------------------------------------------------------------------------------------------
# stats


def test_stats_counts_nan_inf_with_first_rows(tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(10, 4) - 5  # -5 .. 34; 34 becomes -inf below
    x[3, 1] = np.nan
    x[7, 0] = np.nan
    x[5, 2] = np.inf
    x[9, 3] = -np.inf
    finite = x[np.isfinite(x)]
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "labels.npy", np.array([3, -2, 9, 0, 1, 1, 1, 1, 1, 1], dtype=np.int64))
    td = TensorData(tmp_path)
    for chunk in (None, 1, 3):
        s = td.stats("x", chunk_rows=chunk)
        assert (s["min"], s["max"]) == (-5.0, 33.0)
        assert s["mean"] == pytest.approx(float(finite.mean(dtype=np.float64)))
        assert (s["nan"], s["inf"], s["first_nan_row"], s["first_inf_row"], s["first_bad_row"]) == (2, 2, 3, 5, 3)
        assert s["rows"] == 10
    s = td.stats("labels")
    assert (s["min"], s["max"], s["nan"], s["first_nan_row"], s["first_bad_row"]) == (-2, 9, 0, None, None)
    assert "2 NaN (first row 3), 2 inf (first row 5)" in td.describe()
    with pytest.raises(KeyError, match="no array 'nope'"):
        td.stats("nope")


def test_stats_bf16_and_all_nan(tmp_path):
    save_file({"x": torch.tensor([[1.5, -2.0], [float("nan"), 4.0]], dtype=torch.bfloat16),
               "y": torch.full((2, 1), float("nan"))}, tmp_path / "s.safetensors")
    td = TensorData(tmp_path)
    s = td.stats("x")
    assert (s["min"], s["max"], s["mean"], s["nan"], s["first_nan_row"]) == (-2.0, 4.0, 3.5 / 3, 1, 1)
    s = td.stats("y")
    assert (s["min"], s["mean"], s["nan"], s["first_nan_row"]) == (None, None, 2, 0)


# ---------------------------------------------------------------------------------------------------------------------
# bad input: every problem in one error


def test_bad_npy_folder_reports_every_problem_at_once(tmp_path):
    np.save(tmp_path / "inputs_embeds-00001.npy", np.zeros((5, 2, 3), np.float32))
    np.save(tmp_path / "inputs_embeds-00002.npy", np.zeros((5, 2, 7), np.float32))
    np.save(tmp_path / "labels.npy", np.zeros(8, np.int64))
    np.save(tmp_path / "texts.npy", np.array([["a", 1]], dtype=object), allow_pickle=True)
    np.save(tmp_path / "weights.npy", np.asfortranarray(np.zeros((10, 3), np.float32)))
    full = tmp_path / "extra.npy"
    np.save(full, np.zeros((10, 100), np.float32))
    full.write_bytes(full.read_bytes()[:1000])
    (tmp_path / "broken.npy").write_bytes(b"not numpy at all")
    (tmp_path / "table.csv").write_text("a,b\n")
    (tmp_path / "model.h5").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("ignored")

    with pytest.raises(DataError) as excinfo:
        TensorData(tmp_path)
    problems = _problems(excinfo)
    assert len(problems) == 7, "\n".join(problems)
    assert "data error (7 problems)" in str(excinfo.value)
    _one(problems, "unsupported files model.h5, table.csv", ".npy, .safetensors, .npz or .pt")
    _one(problems, "inputs_embeds shards disagree: inputs_embeds-00002.npy is [5, 2, 7] but inputs_embeds-00001.npy "
                   "is [5, 2, 3]", "re-export inputs_embeds-00002.npy")
    _one(problems, "inputs_embeds has 10 rows but labels has 8",
         "(shards: inputs_embeds: inputs_embeds-00001.npy 5, inputs_embeds-00002.npy 5; labels: labels.npy 8)")
    _one(problems, "texts.npy", "texts has dtype object", "cannot be read without pickle", "fix: save a numeric array")
    _one(problems, "weights.npy", "weights is stored in Fortran (column-major) order",
         "np.save(path, np.ascontiguousarray(a))")
    _one(problems, "extra.npy is truncated: its header says extra [10, 100] float32 needs 4,000 bytes of data but the "
                   "file holds only 872", "save or copy it again")
    _one(problems, "broken.npy", "not a readable .npy file")


def test_bad_safetensors_folder(tmp_path):
    def shard(name: str, **arrays: int) -> None:
        save_file({k: torch.zeros(n, 2) for k, n in arrays.items()}, tmp_path / name)

    shard("shard-0001.safetensors", inputs_embeds=5, labels=5)
    shard("shard-0002.safetensors", inputs_embeds=500, labels=498)
    shard("shard-0003.safetensors", inputs_embeds=5)
    shard("shard-0004.safetensors", inputs_embeds=5, labels=5)
    data = (tmp_path / "shard-0004.safetensors").read_bytes()
    (tmp_path / "shard-0004.safetensors").write_bytes(data[:-8])
    (tmp_path / "shard-0005.safetensors").write_bytes((20).to_bytes(8, "little") + b"{not json at all}   ")

    with pytest.raises(DataError) as excinfo:
        TensorData(tmp_path)
    problems = _problems(excinfo)
    _one(problems, "shard-0002.safetensors: inputs_embeds 500 rows, labels 498")
    _one(problems, "shard-0003.safetensors lacks labels (held by shard-0001.safetensors)",
         "every shard must hold the same arrays (inputs_embeds, labels)")
    _one(problems, "shard-0004.safetensors is truncated: its header says", "ends at data byte 80 but the file holds 72")
    _one(problems, "shard-0005.safetensors", "not a readable .safetensors file: JSONDecodeError")
    assert len(problems) == 4, "\n".join(problems)


def test_folder_level_problems(tmp_path):
    with pytest.raises(DataError, match="tensor data folder not found: .*nowhere"):
        TensorData(tmp_path / "nowhere")

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".hidden").write_text("x")
    with pytest.raises(DataError, match="empty is empty"):
        TensorData(empty)

    parent = tmp_path / "parent"
    (parent / "train").mkdir(parents=True)
    (parent / "val").mkdir()
    (parent / "README").write_text("x")
    with pytest.raises(DataError) as excinfo:
        TensorData(parent)
    (problem,) = _problems(excinfo)
    assert "holds no tensor shards (.npy, .safetensors, .npz or .pt); found train/, val/" in problem
    assert f"point at one of its subfolders, e.g. {parent / 'train'}" in problem

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.save(mixed / "labels.npy", np.zeros(3))
    np.savez(mixed / "rest.npz", x=np.zeros(3))
    with pytest.raises(DataError) as excinfo:
        TensorData(mixed)
    (problem,) = _problems(excinfo)
    assert "mixes shard formats: 1 .npy (labels.npy), 1 .npz (rest.npz)" in problem

    zero = tmp_path / "zero"
    zero.mkdir()
    np.save(zero / "labels.npy", np.zeros(0))
    with pytest.raises(DataError, match="holds 0 examples"):
        TensorData(zero)


def test_whole_shards_above_the_bound_and_unsafe_pt(tmp_path):
    np.savez(tmp_path / "big.npz", x=np.zeros((300, 1000), np.float32), labels=np.zeros(300, np.int64))
    with pytest.raises(DataError) as excinfo:
        TensorData(tmp_path, max_memory_gb=0.001)
    (problem,) = _problems(excinfo)
    assert "shard big.npz needs 1.1 MB, above --max_memory_gb 0.001" in problem  # 1.2e6 bytes in GiB units
    assert "re-save it as .npy or .safetensors shards to stream it" in problem
    assert len(TensorData(tmp_path, max_memory_gb=0.01)) == 300

    pt = tmp_path / "pt"
    pt.mkdir()
    torch.save({"x": torch.zeros(2), "y": torch.zeros(2)}, pt / "a.pt")
    torch.save({"x": torch.zeros(2), "y": ArithmeticError("not a tensor")}, pt / "b.pt")  # needs unpickling
    torch.save([torch.zeros(2)], pt / "c.pt")
    (pt / "d.pt").write_bytes(b"garbage")
    with pytest.raises(DataError) as excinfo:
        TensorData(pt)
    problems = _problems(excinfo)
    assert len(problems) == 3, "\n".join(problems)
    _one(problems, "b.pt", "cannot be read safely with torch.load(weights_only=True)", "no custom classes")
    _one(problems, "c.pt", "holds a list, not a dict of named tensors")
    _one(problems, "d.pt", "cannot be read safely")


def test_batch_above_the_bound_is_refused(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((100, 2500), np.float32))  # 10 kB a row
    td = TensorData(tmp_path, max_memory_gb=0.0001)  # 100 kB
    assert td.batch(range(10))["x"].shape == (10, 2500)
    with pytest.raises(DataError, match=r"a batch of 11 examples needs 107.4 KB, above --max_memory_gb 0.0001"):
        td.batch(range(11))


# ---------------------------------------------------------------------------------------------------------------------
# factories


def test_factory_file_returning_a_dict(tmp_path, monkeypatch):
    (tmp_path / "make_data.py").write_text(
        "import numpy as np, torch\n"
        "def make():\n"
        "    return {'inputs_embeds': np.arange(24, dtype=np.float32).reshape(6, 4), 'labels': torch.arange(6)}\n"
        "def bad():\n"
        "    return {'inputs_embeds': np.zeros((6, 4)), 'labels': torch.arange(5)}\n"
    )
    monkeypatch.chdir(tmp_path)
    td = load_tensor_data("make_data.py:make", max_memory_gb=None)
    assert len(td) == 6 and td.arrays["inputs_embeds"].shape == (6, 4)
    b = td.batch([4, 1])
    assert b["inputs_embeds"].tolist() == [[16, 17, 18, 19], [4, 5, 6, 7]] and b["labels"].tolist() == [4, 1]
    assert td.stats("inputs_embeds")["max"] == 23.0

    with pytest.raises(DataError, match="inputs_embeds has 6 rows but labels has 5"):
        load_tensor_data("make_data.py:bad", max_memory_gb=None)
    with pytest.raises(DataError, match="returned 144 B of tensors in memory, above --max_memory_gb 1e-07"):
        load_tensor_data("make_data.py:make", max_memory_gb=1e-7)
    with pytest.raises(DataError, match="'make_data.py' has no callable 'nope'"):
        load_tensor_data("make_data.py:nope", max_memory_gb=None)


def test_factory_import_errors_name_the_module():
    with pytest.raises(DataError) as excinfo:
        load_tensor_data("no_such_module_xyz.data:make", max_memory_gb=None)
    text = str(excinfo.value)
    assert "cannot import 'no_such_module_xyz.data' for the dataset factory 'no_such_module_xyz.data:make'" in text
    assert "ModuleNotFoundError" in text
    with pytest.raises(DataError, match="cannot import 'missing_file.py'.*no such file: missing_file.py"):
        load_tensor_data("missing_file.py:make", max_memory_gb=None)


def test_factory_returning_a_dataset_or_raising(tmp_path, monkeypatch):
    (tmp_path / "ds_factory.py").write_text(
        "import torch\n"
        "class Items(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 5\n"
        "    def __getitem__(self, i):\n"
        "        return {'x': torch.full((3,), float(i)), 'labels': torch.tensor(i % 2)}\n"
        "def make():\n"
        "    return Items()\n"
        "def boom():\n"
        "    raise RuntimeError('disk on fire')\n"
    )
    monkeypatch.chdir(tmp_path)
    td = load_tensor_data("ds_factory.py:make", max_memory_gb=None)
    assert len(td) == 5 and td.arrays["x"].shape == (5, 3) and td.arrays["labels"].dtype == "int64"
    b = td.batch([3, 0])
    assert b["x"].tolist() == [[3.0] * 3, [0.0] * 3] and b["labels"].tolist() == [1, 0]
    with pytest.raises(DataError, match="the dataset factory 'ds_factory.py:boom' raised RuntimeError: disk on fire"):
        load_tensor_data("ds_factory.py:boom", max_memory_gb=None)
    sys.modules.pop("surefit_user_data_ds_factory", None)


def test_a_folder_path_with_no_factory_is_a_folder(tmp_path):
    np.save(tmp_path / "labels.npy", np.arange(4))
    assert len(load_tensor_data(str(tmp_path), max_memory_gb=0.5)) == 4


# ---------------------------------------------------------------------------------------------------------------------
# the RAM bound, on data larger than it


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _random_pass(td: TensorData, order: np.ndarray, ids: str, check=None) -> tuple[int, int]:
    """Read every row in batches of 64; return (peak RSS increase, bytes returned)."""
    gc.collect()
    base = _rss()
    peak = 0
    seen = np.zeros(len(td), dtype=bool)
    returned = 0
    for i in range(0, len(order), 64):
        idx = order[i : i + 64]
        b = td.batch(idx)
        assert np.array_equal(b[ids].numpy(), idx)  # the right rows, in the order asked
        seen[idx] = True
        returned += sum(t.nbytes for t in b.values())
        peak = max(peak, _rss() - base)
        if check:
            check()
        del b
    assert seen.all()
    return peak, returned


def _write_in_subprocess(code: str, folder: Path) -> None:
    # Built in another process: memory freed here after writing could stay in this process's heap and hide the
    # reads' RSS growth behind a raised baseline.
    subprocess.run([sys.executable, "-c", _PRELUDE + code, str(folder)], check=True)


_PRELUDE = "import sys\nfrom pathlib import Path\nimport numpy as np\nout = Path(sys.argv[1])\n"


def test_npy_streaming_stays_within_max_memory_gb(tmp_path):
    rows, shards = 2_700, 4
    _write_in_subprocess(
        f"for s in range({shards}):\n"
        f"    a = np.zeros(({rows}, 100, 100), np.float32)  # 108 MB a shard, 432 MB in all (> 4 x 0.1 GiB)\n"
        f"    a[:, 0, 0] = np.arange(s * {rows}, (s + 1) * {rows})\n"
        f"    np.save(out / f'inputs_embeds-{{s:05d}}.npy', a)\n"
        f"np.save(out / 'ids.npy', np.arange({rows * shards}, dtype=np.int64))\n",
        tmp_path,
    )
    td = TensorData(tmp_path, max_memory_gb=0.1)
    assert td.footprint() > 4 * 0.1 * GB
    peak, returned = _random_pass(td, np.random.default_rng(0).permutation(len(td)), "ids")
    assert returned == td.footprint()  # every byte of the dataset was read, so the bound was really tested
    print(f"npy: {td.footprint() / 1e6:.0f} MB read, peak RSS increase {peak / 1e6:.1f} MB")
    assert peak < 0.1 * GB + 60e6


def test_npz_shard_cache_stays_within_max_memory_gb(tmp_path):
    rows, shards = 750, 4
    _write_in_subprocess(
        f"for s in range({shards}):\n"
        f"    x = np.zeros(({rows}, 10_000), np.float32)  # 30 MB a shard\n"
        f"    ids = np.arange(s * {rows}, (s + 1) * {rows}, dtype=np.int64)\n"
        f"    x[:, 0] = ids\n"
        f"    np.savez(out / f'shard-{{s}}.npz', inputs_embeds=x, ids=ids)\n",
        tmp_path,
    )
    shard_bytes = rows * 40_000 + rows * 8
    td = TensorData(tmp_path, max_memory_gb=0.07)
    most = 0

    def check() -> None:
        nonlocal most
        most = max(most, td.loaded_shard_bytes())
        assert td.loaded_shard_bytes() <= 2 * shard_bytes  # the LRU holds at most 2 of the 4 shards

    peak, returned = _random_pass(td, np.random.default_rng(0).permutation(len(td)), "ids", check)
    assert returned == td.footprint() and most == 2 * shard_bytes
    print(f"npz: random order {td.shard_loads} shard loads, peak RSS increase {peak / 1e6:.1f} MB")
    assert peak < 0.07 * GB + 60e6

    # A shard-aware order loads each shard once instead of reloading them batch after batch.
    random_loads = td.shard_loads
    td = TensorData(tmp_path, max_memory_gb=0.07)
    order = np.array(td.epoch_order(seed=0))
    assert sorted(order.tolist()) == list(range(len(td)))
    _random_pass(td, order, "ids", check)
    assert td.shard_loads == 4 < random_loads
