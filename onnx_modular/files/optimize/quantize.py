"""``optimize --quantize int4``: the fused file quantized with onnxruntime-genai's builder recipe, in one command.

The builder's int4 settings: ``MatMulNBits`` with blocks of 32, symmetric, ``accuracy_level=4``
(int8 activation compute), ``lm_head`` quantized too (or to int8, ``int8_lm_head``). The
quantization is :func:`onnx_modular.files.convert.tool.convert`'s (its passes, onnxruntime's packing),
run on the fused file in a scratch folder; then the accuracy guard
(:mod:`onnx_modular.files.optimize.accuracy_guard`) keeps at ``accuracy_level=0`` the calls whose int8
compute flips a top token, and the result is written where ``optimize`` writes.

Entry: :func:`quantize_fused` (called by :func:`onnx_modular.files.optimize.tool.optimize`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir

from onnx_modular.check.quality import QualityReport
from onnx_modular.errors import InvalidInputError
from onnx_modular.files.optimize.accuracy_guard import INT8_COMPUTE, FeedMaker, GuardReport, guard_accuracy
from onnx_modular.files.optimize.auto import AutoReport
from onnx_modular.format import metadata
from onnx_modular.passes.precision.quantize_weights import QUANTIZE_BITS
from onnx_modular.storage.locks import scratch_folder

__all__ = ["Recipe", "Quantization", "quantize_fused", "check_recipe", "LM_HEAD"]

#: The module ``int8_lm_head`` names (transformers' causal LMs call their output projection so).
LM_HEAD = "lm_head"
#: The file's record of the recipe (JSON).
RECIPE_KEY = metadata.PREFIX + "quantize_recipe"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The quantization of :func:`quantize_fused`; the defaults are the builder's int4 settings."""

    quantize: str = "int4"
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = INT8_COMPUTE
    int8_lm_head: bool = False
    guard: bool = True
    #: ``quantize="auto"``: the calibration file (also measures the uniform recipes' file when given).
    calibration: str | None = None
    #: ``quantize="auto"``: the size budget (:func:`onnx_modular.files.optimize.auto.parse_max_size`'s text).
    max_size: str | None = None

    def command(self) -> str:
        """The ``convert`` options of the recipe (for the report)."""
        if self.quantize == "auto":
            return "--quantize auto" + (f" --max-size {self.max_size}" if self.max_size else "")
        text = f"--quantize {self.quantize} --block-size {self.block_size} --accuracy-level {self.accuracy_level}"
        return text + (" --symmetric" if self.symmetric else "")


@dataclasses.dataclass
class Quantization:
    """What :func:`quantize_fused` did.

    Attributes:
        recipe: The settings.
        matmul_nbits: The ``MatMulNBits`` made, in the (shared) bodies (``lm_head``'s included).
        qmoe: The fused experts (``MoE``) made ``QMoE`` (their weights packed inside the op).
        lm_head: ``int4``/``int8`` when the ``lm_head`` call was quantized, else ``None``.
        skipped: Weights left float, as ``(call, node, reason)``.
        guard: The accuracy guard's report (``None`` when off or not needed: level other than 4).
        tied_embedding: The embedding reads ``lm_head``'s packed int4 table (tied embeddings:
            ``GatherBlockQuantized``, :mod:`onnx_modular.passes.precision.tied_weights`).
        auto: ``quantize="auto"``'s choices and measures (:class:`~onnx_modular.files.optimize.auto.AutoReport`).
        quality: The file against the float (fused) file on the calibration ids, when given.
    """

    recipe: Recipe
    matmul_nbits: int
    lm_head: str | None
    skipped: list[tuple[str, str, str]]
    guard: GuardReport | None
    tied_embedding: bool = False
    auto: AutoReport | None = None
    qmoe: int = 0
    quality: QualityReport | None = None

    def text(self) -> str:
        if self.auto is not None:
            return self.auto.text()
        return self._uniform_text() + (("\n" + self.quality.text("Measured on the calibration ids")) if self.quality else "")

    def _uniform_text(self) -> str:
        head = (f"Quantized ({self.recipe.command()}): {self.matmul_nbits} MatMulNBits"
                + (f" and {self.qmoe} QMoE (the experts' weights inside the op)" if self.qmoe else "") + " in the bodies"
                + (f", lm_head {self.lm_head}" if self.lm_head else ", lm_head not quantized")
                + (" (tied: the embedding reads its table, GatherBlockQuantized)" if self.tied_embedding else "")
                + (f"; {len(self.skipped)} weights left float" if self.skipped else ""))
        if self.guard is not None:
            return head + "\n" + self.guard.text()
        if self.recipe.accuracy_level == INT8_COMPUTE:
            return head + "\nAccuracy guard: off (--no-accuracy-guard)"
        return head


def check_recipe(recipe: Recipe) -> None:
    """The recipe makes sense, or a typed error says what to change (before any work)."""
    if recipe.quantize == "auto" or recipe.max_size is not None:
        _check_auto(recipe)
        return
    if not recipe.quantize:
        raise InvalidInputError("optimize: int8_lm_head quantizes lm_head beside the rest: it needs quantize.",
                                hint="Add --quantize int4.")
    if recipe.quantize not in QUANTIZE_BITS:
        raise InvalidInputError(f"optimize: quantize must be one of {', '.join(QUANTIZE_BITS)}, not {recipe.quantize!r}.",
                                hint="Use --quantize int4 (the builder's recipe).")
    if isinstance(recipe.accuracy_level, bool) or recipe.accuracy_level not in (0, 1, 2, 3, 4):
        raise InvalidInputError(f"optimize: accuracy_level must be 0 to 4 (MatMulNBits), not {recipe.accuracy_level!r}.",
                                hint="4 is int8 compute (the builder's), 0 the input's float type.")
    if recipe.int8_lm_head and recipe.quantize == "int8":
        raise InvalidInputError("optimize: int8_lm_head with quantize='int8' asks for nothing more: lm_head is int8 already.",
                                hint="Drop --int8-lm-head, or use --quantize int4.")


def _check_auto(recipe: Recipe) -> None:
    from onnx_modular.files.optimize.auto import parse_max_size

    if recipe.quantize != "auto":
        raise InvalidInputError("optimize: max_size is the budget of quantize='auto'.", hint="Add --quantize auto --calibration FILE.")
    if recipe.calibration is None:
        raise InvalidInputError("optimize: quantize='auto' measures each call's sensitivity on calibration ids: give calibration.",
                                hint="--calibration calib.npz (input_ids [n, seq] int64) or a .txt beside the model's tokenizer.json.")
    if recipe.int8_lm_head:
        raise InvalidInputError("optimize: quantize='auto' chooses lm_head's precision itself: drop int8_lm_head.",
                                hint="Drop --int8-lm-head.")
    parse_max_size(recipe.max_size)


def _lm_head_bits(path: pathlib.Path) -> dict[str, int]:
    """The bits of each MatMulNBits in the bodies of the ``lm_head`` call(s), by call."""
    from onnx_modular.calls import targets as _calls

    model = onnx.load(str(path), load_external_data=False)
    found: dict[str, int] = {}
    try:
        names = _calls.resolve_target(model, LM_HEAD).call_names
    except InvalidInputError:  # no lm_head call (a model that names its head otherwise)
        return found
    for name in names:
        function = _calls.module_calls(model)[name].function
        bits = [next((a.i for a in n.attribute if a.name == "bits"), 4) for n in function.node if n.op_type == "MatMulNBits"]
        if bits:
            found[name] = bits[0]
    return found


def quantize_fused(model: ir.Model, recipe: Recipe, write: Callable[[ir.Model], None], feeds: FeedMaker, *,
                   seed: int = 0, calibration_ids: np.ndarray | None = None,
                   destination: pathlib.Path | None = None) -> Quantization:
    """Quantize ``model`` (the fused file, weights in memory) with ``recipe``, guard it, and ``write`` the result.

    ``feeds``: the guard's reference inputs (``optimize``'s, for the graph inputs of ``model``).
    ``write`` receives the final model, its weights in memory.
    ``calibration_ids``: ``quantize="auto"``'s calibration ids; for the uniform recipes, the file is
    measured on them against the float file (:attr:`Quantization.quality`). ``destination``: where
    ``write`` puts the file (its data file's name is in every external tensor: ``auto``'s budget counts it).

    Raises:
        InvalidInputError: ``int8_lm_head`` and the file has no ``lm_head`` call (the closest names listed).
    """
    from onnx_modular.files.convert.tool import convert

    with scratch_folder("optimize-quantize") as folder:
        fused = folder / "fused.onnx"
        ir.save(model, fused, external_data="fused.onnx.data")
        if recipe.quantize == "auto":
            return _auto(fused, recipe, write, calibration_ids, destination)
        quantized = folder / "quantized.onnx"
        common = {"block_size": recipe.block_size, "symmetric": recipe.symmetric,
                  "accuracy_level": recipe.accuracy_level, "verify": False}
        # the verification is the guard's runs and optimize's final load; convert's own would run the file twice more
        done = convert(fused, quantized, quantize=recipe.quantize, exclude=[LM_HEAD] if recipe.int8_lm_head else (), **common)
        quantized_list, skipped = list(done.quantized), list(done.skipped)
        if recipe.int8_lm_head:  # the MatMuls left float: lm_head's (and those skipped before, skipped again)
            final = folder / "quantized.lm_head.onnx"
            head = convert(quantized, final, quantize="int8", **common)
            quantized_list += head.quantized
            skipped = list(head.skipped)
            quantized = final
        bits = _lm_head_bits(quantized)
        lm_head = None if not bits else ("int8" if set(bits.values()) == {8} else "int4")
        proto = onnx.load(str(quantized), load_external_data=False)
        tied = any(n.op_type == "GatherBlockQuantized" for body in [proto.graph, *proto.functions] for n in body.node)
        qmoe = sum(n.op_type == "QMoE" for body in [proto.graph, *proto.functions] for n in body.node)
        guard = None
        if recipe.guard and recipe.accuracy_level == INT8_COMPUTE:
            guard = guard_accuracy(proto, folder, feeds, level=INT8_COMPUTE, seed=seed, calibration=calibration_ids)
        proto.metadata_props.add(key=RECIPE_KEY, value=json.dumps(dataclasses.asdict(recipe)))
        result = ir.serde.deserialize_model(proto)
        ir.external_data.set_base_dir(result.graph, str(folder))
        ir.external_data.load_to_model(result)  # optimize holds the weights in memory anyway; the scratch folder goes
        measured = _measure(fused, proto, folder, calibration_ids) if calibration_ids is not None else None
        write(result)
    return Quantization(recipe, len(quantized_list) - qmoe, lm_head, skipped, guard, tied, quality=measured, qmoe=qmoe)


def _measure(fused: pathlib.Path, quantized: onnx.ModelProto, folder: pathlib.Path, ids: np.ndarray) -> QualityReport:
    """The quantized file (its weights in ``folder``) against the fused float file on ``ids``."""
    from onnx_modular.check.quality import compare_logits, file_logits

    reference = file_logits(fused, ids, what="the fused float file")
    report = compare_logits(reference, file_logits(quantized.SerializeToString(), ids, external_data_folder=str(folder),
                                                   what="the quantized file"), ids)
    return report


def written_bytes(proto: onnx.ModelProto, file_name: str = "m.onnx") -> int:
    """The bytes ``proto`` takes on disk as ``optimize`` writes it as ``file_name`` (external data when
    large: aligned tensors, each naming the data file; counted with the longest name the writer may
    choose, ``<file>.<8 hex>.data``, when the conventional one is taken)."""
    from onnx_modular.check.quality import file_bytes
    from onnx_modular.storage import save

    model = ir.serde.deserialize_model(proto)
    with scratch_folder("optimize-size") as folder:
        path = folder / file_name
        data = f"{file_name}.00000000.data" if save.wants_external_data(model, None) else None
        ir.save(model, path, external_data=data)
        return file_bytes(path)


def _auto(fused: pathlib.Path, recipe: Recipe, write: Callable[[ir.Model], None], ids: np.ndarray | None,
          destination: pathlib.Path | None) -> Quantization:
    """``quantize="auto"``: :func:`onnx_modular.files.optimize.auto.quantize_auto` on the fused file."""
    from onnx_modular.files.optimize.auto import parse_max_size, quantize_auto

    if ids is None:
        raise InvalidInputError("optimize: quantize='auto' needs calibration ids.", hint="--calibration calib.npz")
    proto, report = quantize_auto(onnx.load(str(fused)), ids, max_size=parse_max_size(recipe.max_size),
                                  size_of=lambda proto: written_bytes(proto, destination.name if destination else "m.onnx"),
                                  metadata_props={RECIPE_KEY: json.dumps(dataclasses.asdict(recipe))})
    write(ir.serde.deserialize_model(proto))
    if destination is not None:  # counted with the longest data-file name; the file as written
        from onnx_modular.check.quality import file_bytes

        report.bytes = file_bytes(destination)
    nbits = sum(1 for body in [proto.graph, *proto.functions] for n in body.node if n.op_type == "MatMulNBits")
    head = next((r.choice for r in report.calls if r.call == LM_HEAD), None)
    return Quantization(recipe, nbits, head, [], None, auto=report, quality=report.measured)
