"""Typed columns (#37): tensors in their own dtype, token sequences, encoded images and the
images source. Spark and Dask write them byte for byte alike, the manifest describes each
column, the loader yields named tensors (exact resume included), bad values are one line."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from shardline.pipelines.config import ImageColumn, PipelineConfig, TensorColumn
from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import TensorSpec, load_manifest
from shardline.pipelines.prepare import prepare
from shardline.pipelines.tensors import parse_tensor
from shardline.training.loader.reader import ShardLoader

from .test_engines_equal import engine_dirs, prepare_both

C, H, W = 3, 8, 6
CLASSES = ["cat", "dog", "owl"]
ROWS = 240
TOKENS = 8  # declared length; raw sequences are 0..11 ids long


def pixels(k: int, size=(H, W)) -> np.ndarray:
    return np.random.default_rng(k).integers(0, 256, (*size, C), dtype=np.uint8)


def tokens(k: int) -> list[int]:
    return [(k + i) % 99 + 1 for i in range(k % 12)]


def grid(k: int) -> list[list[int]]:
    """A uint8 [2, 3] tensor that spells its key: k = g[0][0] + 256 * g[0][1]."""
    return [[k % 256, k // 256, 7], [1, 2, 3]]


def png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def typed_raw(raw: Path, rows: int = ROWS, edit=None) -> Path:
    """Two Parquet files (id, tokens, grid, photo: a path under raw/img/<class>/, y: the
    class name) and the PNGs they name. `edit(frame)` spoils rows for the bad-input cases."""
    (raw / "img").mkdir(parents=True)
    frame = {"id": list(range(rows)), "tokens": [tokens(k) for k in range(rows)],
             "grid": [grid(k) for k in range(rows)], "photo": [], "y": []}
    for k in range(rows):
        cls = CLASSES[k % 3]
        (raw / "img" / cls).mkdir(exist_ok=True)
        (raw / "img" / cls / f"{k}.png").write_bytes(png(pixels(k)))
        frame["photo"].append(f"img/{cls}/{k}.png")
        frame["y"].append(cls)
    if edit:
        edit(frame, raw)
    table = pa.table(frame)
    half = rows // 2
    pq.write_table(table.slice(0, half), raw / "part-0.parquet")
    pq.write_table(table.slice(half), raw / "part-1.parquet")
    return raw


def typed_config(tmp: Path, **source) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "dataset_dir": str(tmp / "dataset"),
        "source": {"format": "parquet", "path": str(tmp / "raw"), **source},
        "features": {
            "key": "id", "label": "y", "numeric": [], "categorical": [], "classes": CLASSES,
            "tensors": {
                "tokens": {"dtype": "int32", "shape": [TOKENS], "pad_id": 0, "truncate": True, "vocab_size": 100},
                "grid": {"dtype": "uint8", "shape": [2, 3]},
            },
            "images": {"photo": {"shape": [C, H, W]}},
        },
        "layout": {"world_size": 2, "rows_per_row_group": 23, "target_shard_bytes": 8192},
    })


@pytest.fixture(scope="module")
def typed(engines, tmp_path_factory) -> dict:
    """One raw input prepared by Spark and by Dask: their fingerprints and dataset folders."""
    tmp = tmp_path_factory.mktemp("typed")
    typed_raw(tmp / "raw")
    cfg = typed_config(tmp)
    return {"fingerprints": prepare_both(engines, cfg), "dirs": engine_dirs(cfg)}


def test_spark_and_dask_write_typed_columns_byte_identically(typed):
    got = typed["fingerprints"]
    assert len(got["spark"]["shards"]) >= 6
    assert got["spark"] == got["dask"]
    d = typed["dirs"]["dask"]
    m = load_manifest(d)
    assert m.tensors == {
        "tokens": TensorSpec(column="tokens", dtype="int32", shape=[TOKENS], encoding="raw"),
        "grid": TensorSpec(column="grid", dtype="uint8", shape=[2, 3], encoding="raw"),
        "photo": TensorSpec(column="photo", dtype="uint8", shape=[C, H, W], encoding="image"),
        "label": TensorSpec(column="y", dtype="int64", shape=[], encoding="plain"),
    }
    # Stored compactly in their own dtype: 4 bytes a token, 1 a uint8; images as encoded.
    types = {f["name"]: f["type"] for f in m.arrow_schema}
    assert types == {"id": "int64", "tokens": "fixed_size_binary[32]", "grid": "fixed_size_binary[6]",
                     "photo": "binary", "y": "int64"}
    shard = pq.read_table(Path(d) / m.splits["train"].shards[0].path)
    k = shard.column("id")[0].as_py()
    assert shard.column("photo")[0].as_py() == png(pixels(k))  # the PNG's own bytes
    assert sum(s.rows for s in m.splits.values()) == ROWS


def _batches(loader: ShardLoader, epoch: int = 0) -> list[dict]:
    return list(loader.epoch(epoch))


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(p.keys() == q.keys() and all(torch.equal(p[n], q[n]) for n in p)
                                    for p, q in zip(a, b))


def _key(row_grid: torch.Tensor) -> int:
    return int(row_grid[0, 0]) + 256 * int(row_grid[0, 1])


def test_the_loader_yields_named_tensors_with_their_dtypes_and_values(typed):
    d = typed["dirs"]["spark"]
    m = load_manifest(d)
    seen = []
    for rank in range(2):
        loader = ShardLoader(m, d, "train", rank, 2, 8, seed=3, shuffle_buffer_rows=30, workers=2)
        batch = next(iter(loader.epoch(0)))
        assert list(batch) == ["tokens", "grid", "photo", "label"]
        assert {n: (t.dtype, tuple(t.shape)) for n, t in batch.items()} == {
            "tokens": (torch.int32, (8, TOKENS)), "grid": (torch.uint8, (8, 2, 3)),
            "photo": (torch.uint8, (8, C, H, W)), "label": (torch.int64, (8,)),
        }
        for b in loader.all_batches(50):
            for i in range(len(b["label"])):
                k = _key(b["grid"][i])
                want = (tokens(k) + [0] * TOKENS)[:TOKENS]  # padded with pad_id, cut at the length
                assert b["tokens"][i].tolist() == want
                assert torch.equal(b["photo"][i], torch.from_numpy(pixels(k).transpose(2, 0, 1).copy()))
                assert int(b["label"][i]) == k % 3
                seen.append(k)
    assert len(seen) == len(set(seen)) == m.splits["train"].rows


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_named_tensors_resume_exactly_mid_epoch(typed, remainder):
    d = typed["dirs"]["dask"]
    m = load_manifest(d)

    def make(workers=0):
        return ShardLoader(m, d, "train", 1, 2, 6, seed=5, remainder=remainder, shuffle_buffer_rows=30,
                           workers=workers)

    full = _batches(make(), 1)
    assert _same(full, _batches(make(workers=3), 1))  # threads do not change the order
    steps = len(full)
    assert steps > 6
    for k, workers in ((1, 0), (3, 2), (steps // 2, 1), (steps - 1, 0)):
        partial = make()
        it = partial.epoch(1)
        head = [next(it) for _ in range(k)]
        state = partial.state_dict()
        it.close()
        resumed = make(workers)
        resumed.load_state_dict(state)
        assert _same(head + _batches(resumed, 1), full), k
    # Spark's shards give the same stream.
    assert _same(full, _batches(ShardLoader(load_manifest(typed["dirs"]["spark"]), typed["dirs"]["spark"], "train",
                                            1, 2, 6, seed=5, remainder=remainder, shuffle_buffer_rows=30, workers=0), 1))


def test_the_images_source_reads_class_folders_on_both_engines(engines, tmp_path):
    img = typed_raw(tmp_path / "raw", rows=120) / "img"
    cfg = PipelineConfig.model_validate({
        "dataset_dir": str(tmp_path / "ds"), "source": {"format": "images", "path": str(img)},
        "features": {"images": {"image": {"shape": [C, H, W]}}}, "layout": {"world_size": 2},
    })
    got = prepare_both(engines, cfg)
    assert got["spark"] == got["dask"]
    d = f"{cfg.dataset_dir}-dask"
    m = load_manifest(d)
    assert m.feature_spec.classes == CLASSES and m.feature_spec.label == "label"  # the folders, sorted
    assert list(m.tensors) == ["image", "label"]
    keys_of = {}
    for info in m.splits.values():
        for s in info.shards:
            t = pq.read_table(Path(d) / s.path)
            assert t.column_names == ["key", "image", "label"]
            for key, data, label in zip(*(t.column(c).to_pylist() for c in t.column_names)):
                keys_of[data] = (key, label)
    assert len(keys_of) == 120
    loader = ShardLoader(m, d, "train", 0, 2, 4, seed=0, shuffle_buffer_rows=10, workers=2)
    batch = next(iter(loader.epoch(0)))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (4, C, H, W)
    # Resized on decode when declared: gray 4 x 3 from the 8 x 6 PNGs.
    spec = m.feature_spec.model_copy(update={"images": {"image": ImageColumn(shape=[1, 4, 3], resize=True)}})
    small = m.model_copy(update={"feature_spec": spec, "tensors": {
        **m.tensors, "image": TensorSpec(column="image", dtype="uint8", shape=[1, 4, 3], encoding="image")}})
    got = next(iter(ShardLoader(small, d, "train", 0, 2, 4, seed=0, shuffle_buffer_rows=10, workers=0).epoch(0)))
    assert got["image"].shape == (4, 1, 4, 3)
    first = batch  # the same order: only the decode differs
    for i in range(4):
        original = first["image"][i].permute(1, 2, 0).numpy()
        want = np.asarray(Image.fromarray(original).convert("L").resize((3, 4), Image.Resampling.BILINEAR))
        assert got["image"][i, 0].numpy().tolist() == want.tolist()


def _spoil(what: str):
    def edit(frame, raw):
        k = 200  # in part-1.parquet
        if what == "shape":
            frame["grid"][k] = [[1, 2], [3, 4]]
        elif what == "dtype":
            frame["grid"][k] = [[300, 0, 0], [1, 2, 3]]
        elif what == "vocab":
            frame["tokens"][k] = [5, 100]
        elif what == "corrupt":
            (raw / frame["photo"][k]).write_bytes(png(pixels(k))[:40])
        elif what == "size":
            (raw / frame["photo"][k]).write_bytes(png(pixels(k, (H, W + 1))))
    return edit


BAD = {
    "shape": r"column 'grid', key 200: value '\[\[1, 2\], \[3, 4\]\]': tensor's shape differs from the declared \[2, 3\]",
    "dtype": r"column 'grid', key 200: .*tensor's values do not fit the declared dtype uint8",
    "vocab": r"column 'tokens', key 200: value '\[5, 100\]': token id outside the vocabulary 0\.\.99 \(vocab_size = 100\)",
    "corrupt": r"column 'photo', key 200: value 'img/owl/200\.png': not a decodable PNG or JPEG image",
    "size": r"column 'photo', key 200: value 'img/owl/200\.png': image is not 8x6 \(height x width\) and "
            r"pipelines\.features\.images\.photo\.resize is off",
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_typed_value_is_one_line_and_nothing_is_written(engines, tmp_path, what):
    typed_raw(tmp_path / "raw", edit=_spoil(what))
    cfg = typed_config(tmp_path)
    with pytest.raises(DataError, match=r"raw/part-1\.parquet: " + BAD[what] + r".*on_bad_rows = 'drop' skips") as e:
        prepare(engines["dask"], cfg)
    assert "\n" not in str(e.value)
    assert not Path(cfg.dataset_dir).exists()


def test_bad_images_are_dropped_and_counted_with_on_bad_rows_drop(engines, tmp_path):
    def edit(frame, raw):
        (raw / frame["photo"][7]).write_bytes(b"\x89PNG broken")
        (raw / frame["photo"][5]).unlink()  # a path to no file
    typed_raw(tmp_path / "raw", rows=60, edit=edit)
    m = prepare(engines["spark"], typed_config(tmp_path, on_bad_rows="drop"))
    assert m.dropped_rows == 2 and sum(s.rows for s in m.splits.values()) == 58


def test_an_image_in_the_images_source_is_named_by_its_file(engines, tmp_path):
    img = typed_raw(tmp_path / "raw", rows=30) / "img"
    (img / "dog" / "7.png").write_bytes(b"not a png")
    cfg = PipelineConfig.model_validate({
        "dataset_dir": str(tmp_path / "ds"), "source": {"format": "images", "path": str(img)},
        "features": {"images": {"image": {"shape": [C, H, W]}}},
    })
    with pytest.raises(DataError, match=r"img/dog/7\.png: column 'image', key \d+: value '<9 bytes>': not a decodable"):
        prepare(engines["dask"], cfg)


def test_text_and_parquet_tensors_store_the_same_bytes():
    spec = TensorColumn(dtype="int32", shape=[4], pad_id=9, vocab_size=50)
    rows = [[1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11], None, [49, 50], [1.5, 2]]
    arrow, found = parse_tensor(pa.array([r if r is None or all(isinstance(v, int) for v in r) else None
                                          for r in rows]), spec, [])
    text, found_text = parse_tensor(pa.array([None if r is None else str(r) for r in rows]), spec, ["none"])
    assert text[:5].tobytes() == arrow[:5].tobytes()
    assert text.view(np.int32)[:2].tolist() == [[1, 2, 9, 9], [3, 4, 5, 6]]
    assert found_text["bad_shape"].tolist() == [False, False, True, True, False, False]
    assert found_text["out_of_vocab"].tolist() == [False, False, False, False, True, False]
    assert found_text["bad_dtype"].tolist() == [False] * 5 + [True]
    # bfloat16: the top half of float32, rounded to nearest even as torch rounds.
    x = np.array([[1.0, 3.14159, -2.5e-3, 65504.0, 1e38, 0.1]], np.float32)
    bf, _ = parse_tensor(pa.array(x.tolist()), TensorColumn(dtype="bfloat16", shape=[6]), [])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert bf.view(np.uint16).tolist() == want.tolist()


def test_packed_token_sequences_fill_the_declared_length():
    spec = TensorColumn(dtype="int32", shape=[6], pad_id=9, truncate=True, pack=True)
    rows = [[[1, 2], [3]], [[1, 2, 3], [4, 5, 6], [7]], None, [[]], [[5], None]]
    arrow, found = parse_tensor(pa.array(rows), spec, [])
    text, found_text = parse_tensor(pa.array([None if r is None else str(r).replace("None", "null") for r in rows]),
                                    spec, ["null"])
    assert arrow.tobytes() == text.tobytes()
    assert arrow.view(np.int32).tolist()[:4] == [[1, 2, 3, 9, 9, 9], [1, 2, 3, 4, 5, 6], [0] * 6, [9] * 6]
    assert found["bad_shape"].tolist() == found_text["bad_shape"].tolist() == [False, False, True, False, True]


def _smooth(k: int, size=(16, 12), gray: bool = False) -> np.ndarray:
    """A smooth image (JPEG keeps it within a few levels), distinct per k (k < 4: no wrap past 255)."""
    yy, xx = np.mgrid[0 : size[0], 0 : size[1]]
    a = np.stack([10 + 25 * k + 5 * xx + 3 * yy + 20 * c for c in range(3)], axis=-1).astype(np.uint8)
    return a[..., 0] if gray else a


def test_jpeg_images_prepare_and_decode_to_their_pixels(dask_client, tmp_path):
    """JPEG (.jpg and .jpeg, RGB and gray) beside a PNG in the images source: the shards keep the
    files' bytes, the loader decodes each to uint8 [3, 16, 12] close to its pixels (JPEG is lossy;
    the PNG exact, the gray one repeated over the 3 channels); a truncated JPEG is one line naming
    its file and key; a declared size the images do not have is refused before an engine starts."""
    from shardline.pipelines.checks import check_prepare
    from shardline.engines import DaskEngine

    dask = DaskEngine(dask_client)  # the session's; no Spark needed here
    img = tmp_path / "img"
    made = {}  # file bytes -> (pixels [H, W, 3], is it lossless)
    for k, (cls, name, gray) in enumerate([("cat", "0.jpg", False), ("cat", "1.jpeg", True),
                                           ("dog", "2.JPG", False), ("dog", "3.png", False)]):
        (img / cls).mkdir(parents=True, exist_ok=True)
        a = _smooth(k, gray=gray)
        Image.fromarray(a).save(img / cls / name, "PNG" if name.endswith("png") else "JPEG", quality=92)
        made[(img / cls / name).read_bytes()] = (np.stack([a] * 3, -1) if gray else a, name.endswith("png"))

    def config(path: Path, shape=(3, 16, 12), name: str = "ds") -> PipelineConfig:
        return PipelineConfig.model_validate({
            "dataset_dir": str(tmp_path / name), "source": {"format": "images", "path": str(path)},
            "features": {"images": {"image": {"shape": list(shape)}}},
            "split": {"train": 1.0, "val": 0.0, "test": 0.0}, "layout": {"world_size": 1},
        })

    m = prepare(dask, config(img))
    stored = pq.read_table(tmp_path / "ds" / m.split("train").shards[0].path).column("image").to_pylist()
    assert sorted(stored) == sorted(made)  # kept encoded, as the files were
    loader = ShardLoader(m, str(tmp_path / "ds"), "train", 0, 1, 2, seed=0, workers=1)
    decoded = torch.cat([b["image"] for b in loader.all_batches(2)])
    assert decoded.dtype == torch.uint8 and decoded.shape == (4, 3, 16, 12)
    for data, got in zip(stored, decoded):  # all_batches: shard order
        want, exact = made[data]
        err = np.abs(got.permute(1, 2, 0).numpy().astype(int) - want.astype(int))
        assert (err.max() == 0) if exact else err.mean() < 3, (exact, err.mean(), err.max())

    bad = tmp_path / "bad"
    for cls in ("cat", "dog"):
        (bad / cls).mkdir(parents=True)
        (bad / cls / "0.jpg").write_bytes((img / "cat" / "0.jpg").read_bytes())
    (bad / "dog" / "0.jpg").write_bytes((img / "cat" / "0.jpg").read_bytes()[:-150])  # truncated
    with pytest.raises(DataError, match=r"bad/dog/0\.jpg: column 'image', key \d+: value '<\d+ bytes>': "
                                        r"not a decodable PNG or JPEG image") as e:
        prepare(dask, config(bad, name="bad-ds"))
    assert "\n" not in str(e.value) and not (tmp_path / "bad-ds").exists()
    # The first image decoded on the driver: a size the images do not have, before any engine.
    with pytest.raises(DataError, match=r"img/cat/0\.jpg: column 'image', key \d+: value '<\d+ bytes>': "
                                        r"image is not 16x16 \(height x width\)"):
        check_prepare(config(img, shape=(3, 16, 16)))
