"""How far a quantized decoder is from its float file, measured on given token ids (torch-free).

``quality(quantized, reference, input_ids)`` runs both with-cache files (any file
:func:`onnx_modular.generate` runs: ours, onnxruntime-genai's builder's) on every row of
``input_ids`` as a prompt with an empty cache and compares the next-token distributions at every
position:

* **mean next-token KL** ``KL(reference || quantized)`` in nats, averaged over positions (and its 99th percentile);
* **top-1 agreement**: the fraction of positions whose most likely next token is the same;
* **perplexity** of each file on the ids themselves (``exp`` of the mean negative log-likelihood of
  each next token): give held-out text for a perplexity that means something.

Each module call's *share* (its KL when it alone is quantized) is measured by the tool that made the
quantized file (``optimize --quantize auto``, :mod:`onnx_modular.files.optimize.auto`) and kept in
:attr:`QualityReport.shares`.

Calibration and evaluation ids come from :func:`load_ids`: an ``.npz`` with ``input_ids``
``[n, seq]`` int64, or a ``.txt`` tokenized with the ``tokenizer.json`` beside the model.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping

import numpy as np

from onnx_modular.errors import InvalidInputError

__all__ = ["QualityReport", "quality", "compare_logits", "file_logits", "load_ids", "check_ids", "file_bytes", "TEXT_ROW"]

#: Tokens per row when a ``.txt`` file is cut into rows.
TEXT_ROW = 128


@dataclasses.dataclass
class QualityReport:
    """A quantized file against its float file on the same ids.

    Attributes:
        positions: Next-token distributions compared (rows x positions).
        kl_mean / kl_p99: ``KL(reference || quantized)`` in nats: mean and 99th percentile over positions.
        top1: Fraction of positions with the same most likely next token.
        perplexity / perplexity_reference: Of the quantized and of the float file on the ids.
        shares: Per module call, the mean KL when that call alone is quantized (when measured).
        bytes: The quantized file's size on disk (model and external data), when known.
    """

    positions: int
    kl_mean: float
    kl_p99: float
    top1: float
    perplexity: float
    perplexity_reference: float
    shares: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes: int | None = None

    def text(self, title: str = "Quality against the float file") -> str:
        lines = [f"{title} ({self.positions} next-token positions): mean KL {self.kl_mean:.3g} nats "
                 f"(p99 {self.kl_p99:.3g}), top-1 agreement {self.top1:.2%}, perplexity {self.perplexity:.4g} "
                 f"(float {self.perplexity_reference:.4g})" + (f", {self.bytes:,} bytes" if self.bytes else "")]
        if self.shares:
            lines.append("  each call's share (mean KL when it alone is quantized):")
            width = max(len(n) for n in self.shares)
            lines += [f"    {name:<{width}}  {kl:.3g}" for name, kl in sorted(self.shares.items(), key=lambda kv: -kv[1])]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def compare_logits(reference: np.ndarray, candidate: np.ndarray, input_ids: np.ndarray) -> QualityReport:
    """The measures of :class:`QualityReport` from the logits of both files (``[n, length, vocab]``)."""
    if reference.shape != candidate.shape:
        raise InvalidInputError(f"The two files' logits differ in shape: {list(reference.shape)} and {list(candidate.shape)}.",
                                hint="Compare a quantized file with the float file it was made from (same vocabulary).")
    ref, cand = _log_softmax(reference), _log_softmax(candidate)
    kl = (np.exp(ref) * (ref - cand)).sum(-1).clip(min=0.0).ravel()
    top1 = float((reference.argmax(-1) == candidate.argmax(-1)).mean())
    ids = np.asarray(input_ids, dtype=np.int64)
    following = ids[:, 1:, None]

    def perplexity(logp: np.ndarray) -> float:
        if ids.shape[1] < 2:
            return float("nan")
        return float(np.exp(-np.take_along_axis(logp[:, :-1], following, -1).mean()))

    return QualityReport(int(kl.size), float(kl.mean()), float(np.percentile(kl, 99)), top1, perplexity(cand), perplexity(ref))


def file_logits(model: str | os.PathLike | bytes, input_ids: np.ndarray, *, external_data_folder: str | None = None,
                what: str = "file") -> np.ndarray:
    """The logits of a with-cache file (a path, or a serialized model whose weights are in
    ``external_data_folder``) on every row of ``input_ids`` as a prompt: ``[n, length, vocab]``."""
    from onnx_modular.runtime.generation import prompt_logits
    from onnx_modular.runtime.sessions import session

    return prompt_logits(session(model, external_data_folder=external_data_folder, what=what), input_ids,
                         head_size=_genai_head_size(model))


def _genai_head_size(model) -> int | None:
    """The head size onnxruntime-genai's ``genai_config.json`` beside a file gives (its builder's cache is ``kv_cache_dim``)."""
    import json

    if isinstance(model, bytes):
        return None
    config = pathlib.Path(model).parent / "genai_config.json"
    if not config.is_file():
        return None
    try:
        return int(json.loads(config.read_text())["model"]["decoder"]["head_size"])
    except (KeyError, ValueError, TypeError):
        return None


def _vocab_of(path: str | os.PathLike) -> int | None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    logits = next((o for o in model.graph.output if o.name == "logits"), model.graph.output[0])
    dims = logits.type.tensor_type.shape.dim
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None


def quality(quantized: str | os.PathLike, reference: str | os.PathLike,
            input_ids: np.ndarray | str | os.PathLike) -> QualityReport:
    """Measure ``quantized`` against ``reference`` (its float file) on ``input_ids``.

    Args:
        quantized / reference: With-cache ``.onnx`` files (``export --task causal-lm-with-past``,
            ``optimize``'s, ``convert``'s, onnxruntime-genai's builder's ``model.onnx``).
        input_ids: ``[n, seq]`` token ids, or an ``.npz`` / ``.txt`` file (:func:`load_ids`).

    Returns:
        A :class:`QualityReport` (mean next-token KL, top-1 agreement, perplexities, bytes).

    Example::

        report = onnx_modular.quality("m.q4.onnx", "m.onnx", "held_out.npz")
        print(report.kl_mean, report.top1)
    """
    for path in (quantized, reference):
        if not pathlib.Path(path).is_file():
            raise InvalidInputError(f"quality: {str(path)!r} does not exist.", hint="Give the quantized and the float .onnx files.")
    ids = input_ids if isinstance(input_ids, np.ndarray) else load_ids(input_ids, vocab=_vocab_of(reference), beside=reference)
    ids = check_ids(ids, _vocab_of(reference), "input_ids")
    report = compare_logits(file_logits(reference, ids, what="float file"), file_logits(quantized, ids, what="quantized file"), ids)
    report.bytes = file_bytes(quantized)
    return report


def file_bytes(path: str | os.PathLike) -> int:
    """The bytes of a model file and the external data files it names."""
    import onnx

    path = pathlib.Path(path)
    model = onnx.load(str(path), load_external_data=False)
    names = {entry.value for t in model.graph.initializer for entry in t.external_data if entry.key == "location"}
    return path.stat().st_size + sum((path.parent / n).stat().st_size for n in names if (path.parent / n).is_file())


def check_ids(ids: np.ndarray, vocab: int | None, what: str) -> np.ndarray:
    """``ids`` is ``[n, seq]`` of integers within ``vocab``, or a typed error says what is wrong."""
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        kind = getattr(ids, "dtype", type(ids).__name__)
        raise InvalidInputError(f"{what} must hold integer token ids (int64), not {kind}.",
                                hint="Save the ids as int64: np.savez(path, input_ids=ids.astype(np.int64)).")
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise InvalidInputError(f"{what} must be [n, seq] with n >= 1 and seq >= 2, not shape {list(ids.shape)}.",
                                hint="One row per text window, e.g. 8 rows of 128 tokens.")
    if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
        bad = int(ids.max() if ids.min() >= 0 else ids.min())
        raise InvalidInputError(f"{what} has the token id {bad}, outside the model's vocabulary [0, {vocab}).",
                                hint="Tokenize with the model's own tokenizer.")
    return ids.astype(np.int64, copy=False)


def load_ids(path: str | os.PathLike, *, vocab: int | None = None, beside: str | os.PathLike | None = None,
             row: int = TEXT_ROW) -> np.ndarray:
    """Token ids ``[n, seq]`` int64 from ``path``: an ``.npz`` with ``input_ids``, or a ``.txt``
    tokenized with the ``tokenizer.json`` beside ``beside`` (the model or checkpoint) and cut into
    rows of ``row`` tokens (the last, shorter, dropped).

    Raises:
        InvalidInputError: The file is missing, of another kind, without ``input_ids``, of another
            dtype or shape, with ids past ``vocab``, or a ``.txt`` without a tokenizer beside the model.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise InvalidInputError(f"The calibration file {str(path)!r} does not exist.",
                                hint="Give an .npz with input_ids [n, seq] int64, or a .txt beside a tokenizer.json.")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays: Mapping[str, np.ndarray] = {k: data[k] for k in data.files}
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"{str(path)!r} is not a readable .npz file: {e}", hint="Write it with np.savez.") from e
        if "input_ids" not in arrays:
            raise InvalidInputError(f"{str(path)!r} has no array named 'input_ids' (it has {sorted(arrays)}).",
                                    hint="np.savez(path, input_ids=ids) with ids [n, seq] int64.")
        return check_ids(arrays["input_ids"], vocab, f"input_ids of {path.name}")
    if path.suffix == ".txt":
        return check_ids(_tokenize(path, beside, row), vocab, f"the tokens of {path.name}")
    raise InvalidInputError(f"{str(path)!r}: calibration files are .npz (input_ids) or .txt, not {path.suffix or 'no suffix'!r}.",
                            hint="np.savez('calib.npz', input_ids=ids), or a .txt of plain text.")


def _tokenize(path: pathlib.Path, beside: str | os.PathLike | None, row: int) -> np.ndarray:
    folder = pathlib.Path(beside).parent if beside is not None and pathlib.Path(beside).is_file() else pathlib.Path(beside or ".")
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise InvalidInputError(f"A .txt calibration file needs the model's tokenizer: no tokenizer.json in {str(folder)!r}.",
                                hint="Put the checkpoint's tokenizer.json beside the .onnx file, or give an .npz of input_ids.")
    import tokenizers

    ids = np.asarray(tokenizers.Tokenizer.from_file(str(tokenizer_file)).encode(path.read_text(encoding="utf-8")).ids, np.int64)
    if len(ids) < row:
        raise InvalidInputError(f"{str(path)!r} tokenizes to {len(ids)} tokens, fewer than one row of {row}.",
                                hint="Give more text (a few thousand tokens).")
    count = len(ids) // row
    return ids[: count * row].reshape(count, row)
