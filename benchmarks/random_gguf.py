"""A GGUF file's twin with random weights: the same metadata (tokenizer included), tensor names,
shapes and quantization types, for machines the file cannot reach (a lent device machine takes
64 MiB a call; the default model's file is 98 MB). Two steps:

    python benchmarks/random_gguf.py layout SRC.gguf LAYOUT.json    (here: ~2 MB, the vocabulary)
    python benchmarks/random_gguf.py write LAYOUT.json DEST.gguf    (there)

Q4_1 and Q8_0 blocks are drawn directly (codes uniform, scales as a trained model's small weights
give, about 0.04 standard deviation), F32 vectors (norms) near 1, any other type quantized from
normal values by gguf. A decoder reads the twin as it reads the file: the same bytes per token, the
same kernels; what it writes is noise. Throughput on the twin and on the file are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

WRITER_KEYS = ("GGUF.", "general.architecture")  # the writer sets these itself


def _field_value(field):
    """A reader field's value as JSON holds it: a scalar, a string, or a list of either."""
    if field.types[0] == GGUFValueType.ARRAY:
        return [_part_value(field, i, field.types[1]) for i in field.data]
    return _part_value(field, field.data[0], field.types[0])


def _part_value(field, index: int, vtype: GGUFValueType):
    part = field.parts[index]
    if vtype == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def layout(src: Path, out: Path) -> None:
    reader = GGUFReader(str(src))
    fields = []
    for key, field in reader.fields.items():
        if key.startswith(WRITER_KEYS):
            continue
        types = [t.name for t in field.types]
        fields.append({"key": key, "types": types, "value": _field_value(field)})
    tensors = [{"name": t.name, "shape": [int(n) for n in reversed(t.shape)], "type": t.tensor_type.name}
               for t in reader.tensors]
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    out.write_text(json.dumps({"architecture": arch, "fields": fields, "tensors": tensors}))
    print(f"{out}: {len(fields)} fields, {len(tensors)} tensors of {src.name}")


def _random_blocks(kind: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes a row) of `kind` blocks for a matrix of `shape` (rows, K)."""
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    blocks = rows * k // 32
    if kind == "Q4_1":  # d, m (float16), 16 bytes of nibbles: values d * q + m, q in 0..15
        d = rng.uniform(0.006, 0.012, blocks).astype(np.float16)
        m = (-7.5 * d.astype(np.float32)).astype(np.float16)
        codes = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
        raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), codes], axis=1)
    elif kind == "Q8_0":  # d (float16), 32 int8 codes: values d * q
        d = rng.uniform(0.0003, 0.0006, blocks).astype(np.float16)
        codes = rng.integers(-127, 128, (blocks, 32), dtype=np.int8).view(np.uint8)
        raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), codes], axis=1)
    else:
        return quantize(rng.standard_normal((rows, k), dtype=np.float32) * 0.04, GGMLQuantizationType[kind])
    return raw.reshape(rows, -1)


def write(layout_path: Path, dest: Path, seed: int) -> None:
    spec = json.loads(layout_path.read_text())
    writer = GGUFWriter(str(dest), spec["architecture"])
    for field in spec["fields"]:
        types = [GGUFValueType[t] for t in field["types"]]
        writer.add_key_value(field["key"], field["value"], types[0], types[1] if len(types) > 1 else None)
    rng = np.random.default_rng(seed)
    for tensor in spec["tensors"]:
        kind, shape = tensor["type"], tensor["shape"]
        if kind == "F32":
            writer.add_tensor(tensor["name"], rng.uniform(0.8, 1.2, shape).astype(np.float32))
        else:
            writer.add_tensor(tensor["name"], _random_blocks(kind, shape, rng), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{dest}: {len(spec['tensors'])} tensors with random weights, {dest.stat().st_size / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layout", help="a GGUF file's metadata and tensor list as JSON")
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("write", help="a GGUF file of that layout with random weights")
    p.add_argument("layout", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "layout":
        layout(args.src, args.out)
    else:
        write(args.layout, args.dest, args.seed)


if __name__ == "__main__":
    main()
