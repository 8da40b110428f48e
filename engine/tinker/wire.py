"""The Tinker SDK's protobuf wire format, read and written with the SDK's own schema
(`tinker.proto.tinker_public_pb2`, so the `tinker` package must be installed where the
service runs): forward_backward requests in, ForwardBackwardOutput and SampleResponse out.

`datums(body, content_encoding)` decodes a ForwardBackwardRequest into
(model_id, loss_fn, loss_fn_config, forward_only, [Datum]) and raises `WireError` (a 400)
naming the field for anything it cannot serve: a chunk that is not encoded text, a tensor
whose dtype or shape is not [T] for the datum's T input tokens, a sparse tensor that is not
1-D CSR, an empty datum."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinker.proto import tinker_public_pb2


class WireError(ValueError):
    """The request body cannot be decoded or served; the message names the field."""


@dataclass
class Datum:
    """One training example: T input tokens and float32 / int64 inputs of length T each."""
    tokens: list[int]
    inputs: dict[str, torch.Tensor]


def _pb():
    return tinker_public_pb2


def _tensor(msg, field: str, length: int) -> torch.Tensor:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64,
              pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise WireError(f"{field}: dtype {msg.dtype} is not served (float32, int64)")
    np_dtype = dtypes[msg.dtype]
    shape = list(msg.shape) or None
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        values = np.frombuffer(csr.values, dtype=np_dtype)
        if shape is None or len(shape) != 1 or len(crow) != 2 or len(col) != len(values) \
                or (len(col) and (col.min() < 0 or col.max() >= shape[0])):
            raise WireError(f"{field}: only a 1-D sparse CSR tensor with its shape is served")
        dense = np.zeros(shape[0], dtype=np_dtype)
        dense[col] = values
    else:
        if len(msg.dense) % np.dtype(np_dtype).itemsize:
            raise WireError(f"{field}: {len(msg.dense)} bytes are not whole "
                            f"{np.dtype(np_dtype).name} values")
        dense = np.frombuffer(msg.dense, dtype=np_dtype).copy()
        if shape is not None and (len(shape) != 1 or shape[0] != dense.size):
            raise WireError(f"{field}: shape {shape} does not match its {dense.size} values "
                            "(served: 1-D, one value per input token)")
    if dense.size != length:
        raise WireError(f"{field}: {dense.size} values for {length} input tokens (one per "
                        "input token)")
    if not np.all(np.isfinite(dense.astype(np.float64))):
        raise WireError(f"{field}: values must be finite")
    kind = torch.long if np.issubdtype(np_dtype, np.integer) else torch.float32
    return torch.from_numpy(np.ascontiguousarray(dense)).to(kind)


def decode_forward_backward(body: bytes, content_encoding: str | None):
    """(model_id, loss_fn, loss_fn_config dict, forward_only, [Datum]); WireError on bad input."""
    if content_encoding == "zstd":
        import zstandard   # optional: only a zstd-compressed body needs it (the SDK's choice)
        try:
            body = zstandard.ZstdDecompressor().decompress(body)
        except zstandard.ZstdError as e:
            raise WireError(f"body: not zstd ({e})") from None
    elif content_encoding not in (None, "", "identity"):
        raise WireError(f"Content-Encoding {content_encoding!r} is not served (zstd, identity)")
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:   # protobuf's DecodeError
        raise WireError(f"body: not a ForwardBackwardRequest protobuf ({e})") from None
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk") if chunk.DESCRIPTOR.oneofs else None
            if kind != "encoded_text":
                raise WireError(f"data[{i}].model_input.chunks[{j}]: chunk type {kind!r} is not "
                                "served (encoded_text)")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        if not tokens:
            raise WireError(f"data[{i}].model_input: no tokens")
        inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}", len(tokens))
                  for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    if not data:
        raise WireError("forward_backward_input.data: no datums")
    return msg.model_id, msg.loss_fn, config, msg.forward_only, data


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict) -> bytes:
    """A ForwardBackwardOutput protobuf: one ArrayRecord of float32 per-datum arrays."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        arrays = [np.asarray(o[name], dtype=np.float32) for o in outputs]
        bt = record.fields[name]
        bt.dtype = pb.DTYPE_FLOAT32
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    return msg.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]],
                    prompt_logprobs: list[float] | None) -> bytes:
    """A SampleResponse protobuf: (tokens, logprobs, stop reason 'stop'|'length') per sequence;
    prompt_logprobs with NaN at position 0."""
    pb = _pb()
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
