"""``modularize`` on files stripped of every name: the inferred call tree against the export's.

Per architecture (small random configs): torch's flat file (``torch.onnx.export(dynamo=True)``),
a copy stripped of node names, metadata, doc strings and weight names (``files/strip.py``), and
``export_modular``'s file of the same model. The ground-truth layers are the outermost repeated
calls of ``export_modular``'s call tree that are items of a container (``h.0``, ``layers.3``); their
nodes in the flat file are those whose torch scopes hold that path (the stripped copy keeps the
node order). A layer is found when an inferred top-level block holds the same nodes that depend on
an input (Jaccard >= 0.9; ``exact``: the same set). Then the time of ``infer_calls`` against the
node count on synthetic decoders (no torch). Prints two Markdown tables (docs/modularize.md).

    python bench/bench_inferred.py [--only gpt2,bert] [--skip-scale] [--scale-max 100000]
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
import tempfile
import time

import _common  # noqa: F401  (warnings and logging quiet, tests/ on the path)
import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import torch
import transformers

from onnx_modular import export_modular
from onnx_modular.calls import inferred
from onnx_modular.files.modularize.tool import modularize
from onnx_modular.files.strip import strip_names
from onnx_modular.format import metadata

# -- models ----------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class _ResNet(torch.nn.Module):
    """A small ResNet: a stem, two stages of three residual blocks, a pooled head."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.layer1 = torch.nn.Sequential(*[_Block(8) for _ in range(3)])
        self.down = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.layer2 = torch.nn.Sequential(*[_Block(16) for _ in range(3)])
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.down(self.layer1(self.stem(x))))
        return self.fc(x.mean(dim=(2, 3)))


def _ids(n: int = 8, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n))


def _models():
    t = transformers
    small = dict(vocab_size=64)
    llama = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, use_cache=False, **small)
    yield "GPT-2", lambda: t.GPT2LMHeadModel(t.GPT2Config(n_layer=4, n_embd=32, n_head=2, use_cache=False, **small)), (_ids(),)
    yield "BERT", lambda: t.BertModel(t.BertConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=2,
                                                   intermediate_size=64, **small)), (_ids(),)
    yield "Llama", lambda: t.LlamaForCausalLM(t.LlamaConfig(**llama)), (_ids(),)
    yield "Qwen2", lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**llama)), (_ids(),)
    yield "T5", lambda: t.T5ForConditionalGeneration(t.T5Config(num_layers=3, num_decoder_layers=3, d_model=32, d_kv=8,
                                                                d_ff=64, num_heads=4, use_cache=False, **small)), (
        _ids(), torch.ones(1, 8, dtype=torch.long), _ids(6))
    yield "BART", lambda: t.BartForConditionalGeneration(t.BartConfig(
        encoder_layers=3, decoder_layers=3, d_model=32, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False, **small)), (
        _ids(), torch.ones(1, 8, dtype=torch.long), _ids(6))
    yield "ViT", lambda: t.ViTModel(t.ViTConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=2,
                                                intermediate_size=64, image_size=32, patch_size=8)), (
        torch.randn(1, 3, 32, 32),)
    yield "ResNet (own)", _ResNet, (torch.randn(1, 3, 16, 16),)


# -- ground truth ------------------------------------------------------------------------------------


def _layers(tree) -> list[str]:
    """Module paths of the outermost repeated container items (``h.0``, ``encoder.layer.1``)."""
    found: list[str] = []

    def visit(call):
        groups: dict[str, list] = {}
        for child in call.children:
            if child.module_path.rpartition(".")[2].isdigit():
                groups.setdefault(child.qualified_class, []).append(child)
        repeated = {id(c) for group in groups.values() if len(group) >= 2 for c in group}
        for child in call.children:
            if id(child) in repeated:
                found.append(child.module_path)
            else:
                visit(child)

    visit(tree.root)
    return found


def _flat_scopes(path: pathlib.Path) -> list[list[str]]:
    model = onnx.load(str(path), load_external_data=False)
    scopes = []
    for node in model.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        text = props.get(metadata.NAME_SCOPES)
        scopes.append(ast.literal_eval(text) if text else [])
    return scopes


def _resort(stripped: pathlib.Path, output: pathlib.Path, seed: int = 0) -> list[int]:
    """A copy of the file in another topological order (a random pick among the ready nodes, as a
    graph tool that sorts again may leave it); returns each new position's original index."""
    model = onnx.load(str(stripped))
    rng = np.random.default_rng(seed)
    nodes = list(model.graph.node)
    made = {name: i for i, node in enumerate(nodes) for name in node.output}
    needs = [{made[name] for name in node.input if name in made} for node in nodes]
    readers: list[list[int]] = [[] for _ in nodes]
    for i, inputs in enumerate(needs):
        for j in inputs:
            readers[j].append(i)
    waiting = [len(inputs) for inputs in needs]
    ready, order = [i for i, count in enumerate(waiting) if count == 0], []
    while ready:
        i = ready.pop(int(rng.integers(len(ready))))
        order.append(i)
        for j in readers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)
    onnx.save(model, str(output))
    return order


def _compare(flat: pathlib.Path, stripped: pathlib.Path, layers: list[str], origin: list[int] | None = None) -> dict:
    scopes = _flat_scopes(flat)
    model = ir.load(str(stripped))
    common_passes.ShapeInferencePass(strict_mode=False)(model)
    index = {node: (origin[i] if origin else i) for i, node in enumerate(model.graph)}
    # Nodes that depend on an input and that torch gave a scope (it leaves a few without: a Split).
    skeleton = {index[n] for n in inferred._skeleton(list(model.graph), [v for v in model.graph.inputs if not v.is_initializer()])}
    skeleton &= {i for i, s in enumerate(scopes) if s}
    found = inferred.infer_calls(model)
    blocks: dict[str, set[int]] = {}
    for node, keys in found.keys.items():
        if keys[0].startswith("block"):
            blocks.setdefault(keys[0], set()).add(index[node])
    truth = {path: {i for i, s in enumerate(scopes) if path in s} for path in layers}
    matched_truth, matched_blocks, exact, ratios = set(), set(), 0, []
    for path, nodes in truth.items():
        core = nodes & skeleton
        best, score = None, 0.0
        for key, members in blocks.items():
            union = len(core | (members & skeleton))
            jaccard = len(core & members) / union if union else 0.0
            if jaccard > score:
                best, score = key, jaccard
        if best is not None and score >= 0.9:
            matched_truth.add(path)
            matched_blocks.add(best)
            exact += score == 1.0
            ratios.append(len(blocks[best]) / len(nodes))
    return {
        "layers": len(truth),
        "blocks": len(blocks),
        "recall": len(matched_truth) / len(truth) if truth else float("nan"),
        "precision": len(matched_blocks) / len(blocks) if blocks else float("nan"),
        "exact": exact,
        "ratio": float(np.mean(ratios)) if ratios else float("nan"),
        "regions": [(r.length, r.count, [p for _, _, p in r.parts]) for r in found.regions],
    }


def _repeated_functions(path: pathlib.Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    counts = [{p.key: p.value for p in f.metadata_props}.get(metadata.CALL_COUNT, "1") for f in model.functions]
    return sum(int(c) >= 2 for c in counts)


def run_models(only: set[str] | None) -> None:
    print("| model | nodes | layers (export) | blocks found | recall | precision | exact | block/layer nodes "
          "| repeated functions (inferred / export) | outputs | time | re-sorted: recall / precision |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, build, args in _models():
        if only and name.split()[0].lower().replace("-", "") not in only:
            continue
        torch.manual_seed(0)
        model = build().eval()
        with tempfile.TemporaryDirectory() as folder:
            folder = pathlib.Path(folder)
            flat, stripped = folder / "flat.onnx", folder / "stripped.onnx"
            try:
                with torch.no_grad():
                    torch.onnx.export(model, args, str(flat), dynamo=True, verbose=False)
                    result = export_modular(model, args, folder / "modular.onnx", verify=False)
            except Exception as e:
                print(f"| {name} | export failed: {type(e).__name__}: {str(e)[:80]} |")
                continue
            strip_names(flat, stripped)
            layers = _layers(result.hierarchy)
            start = time.perf_counter()
            try:
                report = modularize(stripped, folder / "inferred.onnx")
            except Exception as e:
                print(f"| {name} | modularize failed: {type(e).__name__}: {str(e)[:120]} |")
                continue
            seconds = time.perf_counter() - start
            row = _compare(flat, stripped, layers)
            resorted = _compare(flat, folder / "resorted.onnx", layers, _resort(stripped, folder / "resorted.onnx"))
            ours = _repeated_functions(folder / "inferred.onnx")
            theirs = _repeated_functions(folder / "modular.onnx")
            print(f"| {name} | {report.nodes} | {row['layers']} | {row['blocks']} | {row['recall']:.2f} | "
                  f"{row['precision']:.2f} | {row['exact']}/{row['layers']} | {row['ratio']:.2f} | {ours} / {theirs} | "
                  f"{'equal' if report.parity and report.parity.ok else 'DIFFER'} | {seconds:.1f} s | "
                  f"{resorted['recall']:.2f} / {resorted['precision']:.2f} |")
            print(f"<!-- {name}: regions (length, copies, parts) {row['regions']} -->", file=sys.stderr)


# -- scale -------------------------------------------------------------------------------------------


def synthetic_decoder(layers: int, hidden: int = 64, seq: int = 16) -> ir.Model:
    """A pre-norm decoder of ``layers`` layers (attention and MLP, ~30 nodes a layer), no names."""
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    count = [0]

    def value() -> str:
        count[0] += 1
        return f"t{count[0]}"

    def weight(*shape) -> str:
        name = f"w{len(inits)}"
        inits.append(nh.from_array(rng.standard_normal(shape).astype(np.float32) * 0.02, name))
        return name

    def op(op_type, *inputs, **attrs) -> str:
        out = value()
        nodes.append(oh.make_node(op_type, list(inputs), [out], **attrs))
        return out

    heads = 4
    shape_heads = f"w{len(inits)}"
    inits.append(nh.from_array(np.array([1, seq, heads, hidden // heads], np.int64), shape_heads))
    shape_back = f"w{len(inits)}"
    inits.append(nh.from_array(np.array([1, seq, hidden], np.int64), shape_back))
    x = op("Gather", weight(64, hidden), "ids")
    for _ in range(layers):
        a = op("LayerNormalization", x, weight(hidden), weight(hidden), axis=-1)
        q, k, v = (op("Transpose", op("Reshape", op("MatMul", a, weight(hidden, hidden)), shape_heads), perm=[0, 2, 1, 3])
                   for _ in range(3))
        s = op("Softmax", op("Mul", op("MatMul", q, op("Transpose", k, perm=[0, 1, 3, 2])), weight(1)), axis=-1)
        o = op("Reshape", op("Transpose", op("MatMul", s, v), perm=[0, 2, 1, 3]), shape_back)
        x = op("Add", x, op("MatMul", o, weight(hidden, hidden)))
        m = op("LayerNormalization", x, weight(hidden), weight(hidden), axis=-1)
        g = op("MatMul", m, weight(hidden, 4 * hidden))
        x = op("Add", x, op("MatMul", op("Mul", g, op("Sigmoid", g)), weight(4 * hidden, hidden)))
    out = op("MatMul", op("LayerNormalization", x, weight(hidden), weight(hidden), axis=-1), weight(hidden, 64))
    graph = oh.make_graph(
        nodes, "graph", [oh.make_tensor_value_info("ids", TensorProto.INT64, [1, seq])],
        [oh.make_tensor_value_info(out, TensorProto.FLOAT, [1, seq, 64])], inits)
    proto = onnx.shape_inference.infer_shapes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))
    return ir.serde.deserialize_model(proto)


def run_scale(maximum: int) -> None:
    print("| layers | nodes | infer_calls | blocks found | modularize (no check) |")
    print("|---|---|---|---|---|")
    layers = 8
    while 25 * layers + 3 <= maximum:  # 25 nodes a layer, 3 around them
        model = synthetic_decoder(layers)
        nodes = len(model.graph)
        start = time.perf_counter()
        found = inferred.infer_calls(model)
        infer_seconds = time.perf_counter() - start
        full = "-"
        if nodes <= 26_000:
            with tempfile.TemporaryDirectory() as folder:
                path = pathlib.Path(folder) / "flat.onnx"
                ir.save(synthetic_decoder(layers), str(path))
                start = time.perf_counter()
                modularize(path, pathlib.Path(folder) / "m.onnx", verify=False)
                full = f"{time.perf_counter() - start:.1f} s"
        copies = sum(r.count for r in found.regions)
        print(f"| {layers} | {nodes:,} | {infer_seconds:.2f} s | {copies} | {full} |")
        layers *= 2


def run_deep_llama(layers: int = 22) -> None:
    """A Llama of TinyLlama-1.1B's depth (22 layers, grouped-query attention) at width 64: the node
    count of a 1B decoder's file (the width changes the weights, not the graph)."""
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=176,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=256, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        with torch.no_grad():
            torch.onnx.export(model, (_ids(16, 256),), str(folder / "flat.onnx"), dynamo=True, verbose=False)
        strip_names(folder / "flat.onnx", folder / "stripped.onnx")
        start = time.perf_counter()
        report = modularize(folder / "stripped.onnx", folder / "m.onnx")
        seconds = time.perf_counter() - start
        copies = sum(r.count for r in report.inferred.regions)
        print(f"| Llama, {layers} layers (TinyLlama-1.1B's depth), width 64 | {report.nodes:,} | {copies} blocks | "
              f"{'equal' if report.parity.ok else 'DIFFER'} | {seconds:.1f} s with the check |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated model names (gpt2,bert,llama,...)")
    parser.add_argument("--skip-models", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--scale-max", type=int, default=100_000, help="largest synthetic file, in nodes")
    args = parser.parse_args()
    if not args.skip_models:
        run_models(set(args.only.split(",")) if args.only else None)
    if not args.skip_scale:
        run_deep_llama()
        run_scale(args.scale_max)


if __name__ == "__main__":
    main()
