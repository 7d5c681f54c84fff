"""Checkpoint file formats, read and written one tensor at a time: safetensors and torch `.bin` (HF side),
MindSpore `.ckpt` (a protobuf stream), and float32/float16/bfloat16 stored data (bfloat16 as uint16 bits, since
numpy has no bfloat16). `labkit.weights.convert` maps names between the two sides on top of this."""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from labkit.errors import LabkitError
from labkit.io import read_json_object

DTYPES = ("float32", "float16", "bfloat16")
_ST = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors dtype tags
_ST_TAG = {v: k for k, v in _ST.items()}
_MS_TAG = {"float32": "Float32", "float16": "Float16", "bfloat16": "BFloat16"}  # MindSpore checkpoint tensor_type
_MS = {v: k for k, v in _MS_TAG.items()}
STORE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # numpy has no bfloat16: keep bits
CKPT_CHUNK = 512 * 1024 * 1024  # MindSpore splits tensors above 512 MiB into several records with the same name


# ---------------------------------------------------------------------------------- dtype helpers


def cast(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Convert stored data between float32/float16/bfloat16 (bfloat16 as uint16 bits; rounding to nearest even)."""
    if src == dst:
        return arr
    if src == "bfloat16":
        f32 = (arr.astype(np.uint32) << 16).view(np.float32)
    else:
        f32 = arr.astype(np.float32)
    if dst == "float32":
        return f32
    if dst == "float16":
        return f32.astype(np.float16)
    u = f32.view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f32), ((u >> 16) | 0x40).astype(np.uint16), bits)


def as_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    return cast(arr, dtype, "float32")


# ------------------------------------------------------------------------------- reading HF checkpoints


@dataclass
class SrcTensor:
    name: str
    dtype: str  # float32 | float16 | bfloat16 | the raw tag when unsupported
    shape: tuple
    file: str
    offset: int | None = None  # absolute byte offset (safetensors)
    nbytes: int = 0


@dataclass
class HFSource:
    root: Path
    config: dict
    format: str  # safetensors | pytorch_bin
    files: list[str]
    index: dict | None
    tensors: list[SrcTensor]
    metadata: dict = field(default_factory=dict)  # safetensors __metadata__ of the first file
    nonfinite: dict = field(default_factory=dict)  # tensor name -> (NaN count, Inf count), filled by read()
    _bin: tuple | None = None

    def read(self, t: SrcTensor) -> np.ndarray:
        arr = self._read(t)
        bad = nonfinite_counts(arr, t.dtype)
        if bad:
            self.nonfinite[t.name] = bad
        return arr

    def nonfinite_warnings(self) -> list[str]:
        """One line per tensor read so far that holds NaN or Inf (such weights make every later number meaningless)."""
        return [f"{name} holds {n_nan} NaN and {n_inf} Inf value(s)" for name, (n_nan, n_inf) in self.nonfinite.items()]

    def _read(self, t: SrcTensor) -> np.ndarray:
        if self.format == "safetensors":
            with open(self.root / t.file, "rb") as f:
                f.seek(t.offset)
                arr = np.fromfile(f, dtype=STORE[t.dtype], count=t.nbytes // np.dtype(STORE[t.dtype]).itemsize)
            return arr.reshape(t.shape)
        import torch

        if self._bin is None or self._bin[0] != t.file:
            self._bin = None  # drop the previous shard before mapping the next
            self._bin = (t.file, _torch_load(self.root / t.file))
        tensor = self._bin[1][t.name]
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(np.uint16)
        return tensor.numpy()


def nonfinite_counts(arr: np.ndarray, dtype: str) -> tuple[int, int] | None:
    """(NaN count, Inf count) of stored data, or None when every value is finite."""
    if dtype not in DTYPES:
        return None
    f = as_float32(arr, dtype) if dtype == "bfloat16" else arr
    if np.isfinite(f).all():
        return None
    return int(np.isnan(f).sum()), int(np.isinf(f).sum())


def _torch_load(path: Path) -> dict:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def _st_header(path: Path) -> tuple[dict, list[SrcTensor]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise LabkitError(f"{path} is not a safetensors file (bad header)", "re-download or re-save the shard")
        try:
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError(f"the header is a JSON {type(header).__name__}")
        except (UnicodeDecodeError, ValueError) as e:
            raise LabkitError(f"{path} has a corrupt safetensors header ({str(e)[:120]})",
                              "re-download or re-save the shard") from None
    meta = header.pop("__metadata__", None) or {}
    out = []
    for name, h in header.items():
        try:
            a, b = h["data_offsets"]
            h["dtype"], h["shape"]
        except (TypeError, KeyError, ValueError):
            raise LabkitError(f"{path} has a corrupt safetensors header (entry '{name}' lacks dtype, shape or "
                              "data_offsets)", "re-download or re-save the shard") from None
        if 8 + n + b > size:
            raise LabkitError(f"{path} is truncated: '{name}' ends past the end of the file", "re-download the shard")
        out.append(SrcTensor(name, _ST.get(h["dtype"], h["dtype"]), tuple(h["shape"]), path.name, 8 + n + a, b - a))
    out.sort(key=lambda t: t.offset)
    return meta, out


def open_hf(src: str | Path) -> HFSource:
    """Read the structure of an HF checkpoint directory (config, files, names, dtypes, shapes), not its data."""
    root = Path(src)
    if not (root / "config.json").is_file():
        raise LabkitError(f"{root / 'config.json'} not found", "--src must be an HF model directory with config.json")
    config = read_json_object(root / "config.json", "the model's configuration")
    for fmt, index_name, single in (("safetensors", "model.safetensors.index.json", "model.safetensors"),
                                    ("pytorch_bin", "pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = None
        if (root / index_name).is_file():
            index = read_json_object(root / index_name, "the shard index")
            if not isinstance(index.get("weight_map"), dict):
                raise LabkitError(f"{root / index_name} has no weight_map object", "restore the index file")
            files = list(dict.fromkeys(index["weight_map"].values()))
            missing = [f for f in files if not (root / f).is_file()]
            if missing:
                raise LabkitError(f"{root / index_name} lists shards that are missing: {', '.join(missing)}",
                                  "copy every shard into the directory")
        elif (root / single).is_file():
            files = [single]
        else:
            continue
        tensors, meta = [], {}
        for i, f in enumerate(files):
            if fmt == "safetensors":
                m, ts = _st_header(root / f)
                meta = meta if i else m
            else:
                ts = [SrcTensor(k, _torch_dtype(v), tuple(v.shape), f, None, v.numel() * v.element_size())
                      for k, v in _torch_load(root / f).items()]
            tensors += ts
        if index is not None:
            stray = sorted(set(index["weight_map"]) ^ {t.name for t in tensors})
            if stray:
                raise LabkitError(f"{index_name} and the shards disagree on: {', '.join(stray[:10])}",
                                  "the index must list exactly the tensors the shards hold")
        return HFSource(root, config, fmt, files, index, tensors, meta)
    raise LabkitError(f"no weights in {root}",
                      "expected model.safetensors, model.safetensors.index.json + shards, or pytorch_model.bin")


def _torch_dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


# ------------------------------------------------------------------------ MindSpore checkpoint streaming


class CkptWriter:
    """Writes a MindSpore checkpoint one tensor at a time. The format is a protobuf `Checkpoint` whose repeated
    `value` records are serialised one by one and concatenated (as `mindspore.save_checkpoint` does; the bytes are
    equal, see tests). The small protobuf framing is encoded here so the tensor data is written without copies."""

    def __init__(self, path: Path):
        self._f = open(path, "wb")
        self.bytes = 0

    def write(self, name: str, arr: np.ndarray, dtype: str) -> None:
        raw = memoryview(np.ascontiguousarray(arr)).cast("B")
        dims = b"".join(b"\x08" + _enc_varint(d) for d in arr.shape)
        for start in range(0, max(len(raw), 1), CKPT_CHUNK):
            piece = raw[start:start + CKPT_CHUNK]
            tensor = dims + _enc_bytes(0x12, _MS_TAG[dtype].encode()) + b"\x1a" + _enc_varint(len(piece))
            value_head = _enc_bytes(0x0A, name.encode()) + b"\x12" + _enc_varint(len(tensor) + len(piece)) + tensor
            head = b"\x0a" + _enc_varint(len(value_head) + len(piece)) + value_head
            self._f.write(head)
            self._f.write(piece)
            self.bytes += len(head) + len(piece)

    def close(self):
        self._f.close()


def _enc_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _enc_bytes(key: int, data: bytes) -> bytes:
    return bytes([key]) + _enc_varint(len(data)) + data


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


@dataclass
class CkptEntry:
    name: str
    dtype: str
    shape: tuple
    chunks: list  # (offset, length) of tensor_content pieces


def ckpt_index(path: str | Path, any_dtype: bool = False) -> dict[str, CkptEntry]:
    """Names, dtypes, shapes and data offsets of a MindSpore checkpoint, in file order, without loading the data.
    With `any_dtype`, tensors of other dtypes (a training state's int32 `global_step`) are listed too, their dtype
    lower-cased from MindSpore's tag ("int32"); without it they are refused (their data cannot be converted)."""
    import mmap

    path = Path(path)
    out: dict[str, CkptEntry] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos, end = 0, len(buf)
        while pos < end:
            if buf[pos:pos + 7] == b"crc_num":
                break
            key, pos = _varint(buf, pos)
            length, pos = _varint(buf, pos)
            if key != 0x0A:
                raise LabkitError(f"{path} is not a plain MindSpore checkpoint (encrypted or corrupt)",
                                  "convert from an unencrypted checkpoint")
            name, dims, tag, content, p, stop = None, [], None, None, pos, pos + length
            while p < stop:  # Checkpoint.Value: tag=1 (string), tensor=2 (TensorProto)
                k, p = _varint(buf, p)
                n, p = _varint(buf, p)
                if k == 0x0A:
                    name = bytes(buf[p:p + n]).decode()
                elif k == 0x12:
                    q, tend = p, p + n
                    while q < tend:  # TensorProto: dims=1 (varint), tensor_type=2, tensor_content=3
                        kk, q = _varint(buf, q)
                        if kk == 0x08:
                            d, q = _varint(buf, q)
                            dims.append(d)
                            continue
                        if kk == 0x0A:  # packed dims
                            nn, q = _varint(buf, q)
                            qe = q + nn
                            while q < qe:
                                d, q = _varint(buf, q)
                                dims.append(d)
                            continue
                        nn, q = _varint(buf, q)
                        if kk == 0x12:
                            tag = bytes(buf[q:q + nn]).decode()
                        elif kk == 0x1A:
                            content = (q, nn)
                        q += nn
                else:
                    raise LabkitError(f"{path}: record '{name}' is not a tensor (map tensors are not supported)")
                p += n
            if tag not in _MS and not any_dtype:
                raise LabkitError(f"{path}: '{name}' has dtype {tag}", "only Float32, Float16 and BFloat16 are supported")
            entry = out.setdefault(name, CkptEntry(name, _MS.get(tag, str(tag).lower()), tuple(dims), []))
            entry.chunks.append(content)
            pos = stop
    return out


def read_ckpt_tensor(path: str | Path, entry: CkptEntry) -> np.ndarray:
    """One tensor's stored data (bfloat16 as uint16 bits)."""
    parts = []
    with open(path, "rb") as f:
        for off, n in entry.chunks:
            f.seek(off)
            parts.append(np.fromfile(f, dtype=np.uint8, count=n))
    raw = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return raw.view(STORE[entry.dtype]).reshape(entry.shape)


# ------------------------------------------------------------------------------------ writing safetensors


def st_write(path: Path, items: list[tuple[str, str, tuple]], fetch, metadata: dict, bar) -> dict[str, int]:
    """Stream a safetensors file: the header is known from (name, dtype, shape); data follows in that order."""
    header, off = {"__metadata__": metadata}, 0
    for name, dt, shape in items:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(STORE[dt]).itemsize
        header[name] = {"dtype": _ST_TAG[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    crcs = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dt, shape in items:
            arr = np.ascontiguousarray(fetch(name, dt))
            view = memoryview(arr).cast("B")
            crcs[name] = zlib.crc32(view)
            f.write(view)
            bar.update(len(view))
    return crcs


# ---------------------------------------------------------------------------------- training checkpoint folders
# `labkit train` writes <output>/checkpoints/step_000012/{state.json,state.ckpt} (labkit.training.checkpoint);
# the layout is here so that conversion (this layer) and training (above it) read it the same way.


def checkpoint_dir(output: Path) -> Path:
    return Path(output) / "checkpoints"


def step_of(path) -> int:
    """The step a checkpoint folder holds, from its name `step_000012`."""
    name = Path(path).name
    try:
        return int(name.split("_", 1)[1])
    except (IndexError, ValueError):
        raise LabkitError(f"{path} is not a checkpoint folder (its name is not step_NNNNNN)") from None


def list_checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output)
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if (p / "state.json").is_file() and (p / "state.ckpt").is_file()]
    return sorted(done, key=step_of)


def latest(output: Path) -> Path | None:
    found = list_checkpoints(output)
    return found[-1] if found else None


def training_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint folder (state.json + state.ckpt) that `path` names: itself, or the newest complete one of a
    run folder; None when it is neither."""
    p = Path(path)
    if (p / "state.json").is_file() and (p / "state.ckpt").is_file():
        return p
    return latest(p)


# what a training checkpoint holds besides the model's weights (optimizer moments, its step, the loss scaler)
TRAINING_STATE = ("adam_", "loss_scale.", "global_step", "learning_rate", "accu_grads.")


def model_entries(index: dict) -> dict:
    """The model weights of a checkpoint index (`ckpt_index`), training state left out."""
    return {n: e for n, e in index.items() if not n.startswith(TRAINING_STATE)}


def weights_file(path: str | Path) -> Path | None:
    """The MindSpore weights file that `path` names: itself (a .ckpt file), a converted directory's model.ckpt or a
    training checkpoint folder's state.ckpt; None when it holds none of them."""
    path = Path(path)
    for candidate in (path, path / "model.ckpt", path / "state.ckpt"):
        if candidate.is_file():
            return candidate
    return None
