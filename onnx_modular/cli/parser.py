"""The command line's arguments: ``build_parser()``, one subparser per command of
:mod:`onnx_modular.cli.commands`."""

from __future__ import annotations

import argparse

from onnx_modular.cli import commands as handlers
from onnx_modular.cli import exporting
from onnx_modular.cli.pipeline import add_pipeline_options


def _json_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json PATH|-``, the same for every command but ``view`` (docs/cli.md, "JSON")."""
    parser.add_argument(
        "--json", default=None, metavar="PATH",
        help=f"write {what} as JSON to PATH ('-': print it on stdout instead of the text)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="print tracebacks of errors"
    )
    parser = argparse.ArgumentParser(
        prog="onnx-modular",
        description="Export PyTorch models to ONNX with every module call as a nested local function, "
        "and inspect, inline, verify or view such files.",
        epilog="Exit codes: 0 ok, 1 verification failure (or diff: the files differ), 2 usage error or bad input, "
        "3 internal error.",
        parents=[common],
    )
    from onnx_modular._version import __version__

    parser.add_argument("--version", action="version", version=f"onnx-modular {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    export = commands.add_parser(
        "export",
        parents=[common],
        help="export a model from a factory function or a transformers checkpoint folder",
        description="Call FACTORY (package.module:function or file.py:function), which returns "
        "(model, args), (model, args, kwargs), (model, args, kwargs, dynamic_shapes) or a dict with "
        "those keys, and export the model with export_modular. Or export a transformers checkpoint "
        "(a folder with config.json and weights, or a model already in the local Hugging Face cache) "
        "for a task (--task, else inferred from config.architectures), with sample inputs built for the task, "
        "dynamic in batch and sequence; needs the [hf] extra. Nothing is downloaded.",
    )
    export.add_argument(
        "factory",
        metavar="FACTORY|CHECKPOINT",
        help="package.module:function, path/file.py:function, or a checkpoint folder",
    )
    export.add_argument(
        "-o",
        "--output",
        required=True,
        help="the .onnx file to write; for a checkpoint, a folder instead writes what "
        "ExportedModel.save_pretrained writes (needed with --generation)",
    )
    export.add_argument(
        "--task",
        default=None,
        metavar="TASK",
        help="what to export a checkpoint for (which head, which sample inputs): feature-extraction, masked-lm, "
        "causal-lm, causal-lm-with-past, seq2seq-lm, image-classification, or Optimum's name (text-generation, "
        "text-generation-with-past, fill-mask, text2text-generation); default: inferred from config.architectures",
    )
    export.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16", "fp32", "fp16", "bf16"],
        help="checkpoint: the precision to export in (default: the checkpoint's; fp32, fp16, bf16 as Optimum "
        "spells them); a bfloat16 file is checked on its float32-widened copy (onnxruntime's CPU provider has no "
        "bfloat16 kernels)",
    )
    export.add_argument("--static", action="store_true", help="checkpoint: fixed shapes (default: dynamic batch and sequence)")
    export.add_argument("--generation", action="store_true",
                        help="checkpoint: export the generation components (prefill, decode) into the -o folder")
    export.add_argument(
        "--io-names",
        default="transformers",
        choices=["transformers", "optimum"],
        help="checkpoint, one .onnx file of causal-lm-with-past: the cache inputs' and outputs' names; transformers "
        "(input.past_key_values.layers.0.keys, what ExportedModel binds; default) or optimum (past_key_values.0.key "
        "in, present.0.key out, on every transformers release: what Optimum's ORTModelForCausalLM feeds)",
    )
    export.add_argument("--genai", action="store_true", help="checkpoint: write a folder onnxruntime-genai runs (model.onnx "
                        "with Optimum's names, genai_config.json, tokenizer files), checked through genai's Generator "
                        "against transformers' generate (docs/genai.md)")
    export.add_argument("--optimize", action="store_true", help="with --genai: the folder carries the file rewritten by "
                        "`optimize` (onnxruntime's fused kernels; GroupQueryAttention lets genai share the cache buffers)")
    export.add_argument("--stream-weights", action="store_true", help="checkpoint: never load the weights whole "
                        "(model on meta, each tensor streamed to <output>.data, verified block by block)")
    export.add_argument("--keep-on-mismatch", action="store_true", help="write the model even when parity fails (exit code 1)")
    export.add_argument("--no-verify", action="store_true", help="skip the onnxruntime-vs-PyTorch parity check")
    export.add_argument("--no-dedupe", action="store_true", help="keep one function per call (no sharing)")
    export.add_argument("--atol", type=float, default=None, help="absolute tolerance of the check (default: per output dtype)")
    export.add_argument("--rtol", type=float, default=None, help="relative tolerance of the check (default: per output dtype)")
    export.add_argument(
        "--flat-file",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="also write the flat deployment copy (every call inlined, optimized, verified) to PATH "
        "(default <name>.flat.onnx beside -o), for runtimes without local functions (OpenVINO; docs/compatibility.md)",
    )
    export.add_argument(
        "--fixed-input",
        action="append",
        default=None,
        metavar="NAME",
        help="a keyword input whose values are fixed into the program (a vision-language model's image_grid_thw or "
        "image_sizes): the file does not take it and serves inputs of that layout (repeatable; export_modular's "
        "fixed_inputs, docs/user-guide.md)",
    )
    export.add_argument(
        "--opset", type=int, default=None, metavar="N", help="ONNX opset of the default domain (17 to 23 and up; default 18)"
    )
    export.add_argument(
        "--depth",
        type=_positive,
        default=2,
        metavar="N",
        help="depth of the printed tree (default 2; 0 = all); --json always has the whole tree",
    )
    _json_option(export, "the summary (paths, parity report, tree)")
    export.set_defaults(run=exporting.run_export)

    tree = commands.add_parser(
        "tree",
        parents=[common],
        help="print the function-call tree of an ONNX file",
        description="Print the call hierarchy of the local functions of any ONNX file: call path, "
        "function, domain, calls of that function in the whole model, nodes in its body, and the "
        "weight elements flowing into the call.",
    )
    tree.add_argument("model", help="the .onnx file")
    tree.add_argument(
        "--depth", type=_positive, default=None, metavar="N", help="show calls down to depth N (0 = all, the default)"
    )
    tree.add_argument(
        "--class",
        dest="class_name",
        default=None,
        metavar="NAME",
        help="keep calls whose function or class matches NAME (a glob such as 'GPT2*'), and their ancestors",
    )
    _json_option(tree, "the tree")
    tree.set_defaults(run=handlers.run_tree)

    inline = commands.add_parser(
        "inline",
        parents=[common],
        help="inline local functions (all, or selected ones)",
        description="Write a copy with local functions inlined by onnx.inliner. The output is written "
        "atomically: a failure leaves no file behind.",
    )
    inline.add_argument("model", help="the .onnx file to read")
    inline.add_argument("output", help="the .onnx file to write")
    inline.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="inline only these functions (NAME or DOMAIN:NAME); calls nested in them stay calls",
    )
    inline.add_argument(
        "--optimize",
        action="store_true",
        help="then run onnxscript's optimizer on the result, as torch.onnx.export does "
        "(shares the per-call constants: a flat file for deployment)",
    )
    inline.add_argument(
        "--opset", type=int, default=None, metavar="N", help="convert the copy to this opset, body by body (17 and up)"
    )
    _json_option(inline, "what was inlined")
    inline.set_defaults(run=handlers.run_inline)

    verify = commands.add_parser(
        "verify",
        parents=[common],
        help="compare the model with its inlined copy in onnxruntime",
        description="Run the model and its inlined copy in onnxruntime on the same inputs (random "
        "from the declared shapes and types, or --inputs) and compare every output.",
    )
    verify.add_argument("model", help="the .onnx file")
    verify.add_argument("--inputs", default=None, metavar="FILE.npz", help="inputs by name (or arr_0, arr_1, ...)")
    verify.add_argument(
        "--expected", default=None, metavar="FILE.npz", help="expected outputs by name; the model must match them too"
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    verify.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size (>= 1) of a symbolic dimension in random inputs (default 2); repeatable",
    )
    verify.add_argument(
        "--atol", type=float, default=None, help="absolute tolerance (default: per output dtype, float32 1e-4)"
    )
    verify.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance (default: per output dtype, float32 1e-3)"
    )
    _json_option(verify, "the report")
    verify.set_defaults(run=handlers.run_verify)

    prof = commands.add_parser(
        "profile",
        parents=[common],
        help="time every module call in onnxruntime (its profiler, on the call tree)",
        description="Run the model in onnxruntime with its profiler and attribute every kernel to the "
        "module call it came from (nodes onnxruntime fuses across modules go to the innermost call "
        "holding all their parts). Prints the call tree with inclusive and self time (sums of the "
        "kernels' medians over the runs), share and kernels, the slowest calls by self time and the "
        "time per class. Inputs are random from the declared shapes unless --inputs is given.",
    )
    prof.add_argument("model", help="the .onnx file")
    prof.add_argument("--inputs", default=None, metavar="FILE.npz", help="inputs by name (or arr_0, arr_1, ...)")
    prof.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    prof.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                      help="size of a symbolic dimension in random inputs (default 2); repeatable")
    prof.add_argument("--runs", type=int, default=10, metavar="N", help="measured runs (default 10)")
    prof.add_argument("--warmup", type=int, default=2, metavar="N", help="runs before them, not measured (default 2)")
    prof.add_argument("--threads", type=int, default=None, metavar="N",
                      help="onnxruntime intra-op threads (default: onnxruntime's)")
    prof.add_argument("--provider", default=None, metavar="EP", help="execution provider (default CPU; cuda, ...)")
    prof.add_argument("--optimization", default="all", choices=["all", "extended", "basic", "disabled"],
                      help="onnxruntime graph optimization level (default all, as onnxruntime)")
    prof.add_argument("--depth", type=_positive, default=None, metavar="N", help="show calls down to depth N")
    prof.add_argument("--top", type=_positive, default=10, metavar="N", help="slowest calls by self time to list (default 10)")
    _json_option(prof, "the profile")
    prof.add_argument("--trace", default=None, metavar="PATH", help="write a Chrome trace (Perfetto, speedscope)")
    prof.add_argument("--html", default=None, metavar="PATH", help="write a self-contained HTML page with a flame chart")
    prof.set_defaults(run=handlers.run_profile)

    extract = commands.add_parser(
        "extract",
        parents=[common],
        help="write one module call (or every call of a class) as a model of its own",
        description="Write the function of a call (a module path such as h.1.attn) or of every call of a "
        "class (GPT2Block: one model per distinct function) as a model: the body as its graph, the formal "
        "inputs as inputs, the weights and constants the call receives as initializers. The output "
        "folder gets one test case per model in ONNX's layout (<case>/model.onnx, test_data_set_<n>/).",
    )
    extract.add_argument("model", help="the .onnx file")
    extract.add_argument("call", help="a module path (h.1.attn) or a class or function name (GPT2Block)")
    extract.add_argument("-o", "--output", required=True, metavar="OUT", help="a new or empty folder")
    extract.add_argument(
        "--with-data",
        action="store_true",
        help="also write each call's inputs and outputs from one onnxruntime run of the whole model "
        "(one data set per call), checked on the extracted model",
    )
    extract.add_argument(
        "--inputs", default=None, metavar="FILE.npz", help="the whole model's inputs for --with-data (default: random, seed 0)"
    )
    _json_option(extract, "what was written (models, calls, test data)")
    extract.set_defaults(run=handlers.run_extract)

    split = commands.add_parser(
        "split",
        parents=[common],
        help="cut a model into stages at module boundaries, with a manifest that chains them",
        description="Cut a modular file between consecutive module calls of one graph (opening the calls above "
        "it: between decoder layers, between an encoder and a decoder). Every tensor crossing a cut becomes an "
        "output of one stage and an input of the next; each stage keeps its functions and only its own weights. "
        "DIR gets manifest.json and stage_<k>/model.onnx with the stage's inputs and outputs from one onnxruntime "
        "run as ONNX test data (test_data_set_0/), each checked on its stage. All stages or nothing is written.",
    )
    split.add_argument("model", help="the .onnx file")
    cuts = split.add_mutually_exclusive_group(required=True)
    cuts.add_argument("--stages", type=_positive, metavar="N", help="how many stages (the cuts balance --balance)")
    cuts.add_argument(
        "--at", nargs="+", metavar="PATH", help="the first call of each new stage (call paths of one graph: model.layers.2)"
    )
    split.add_argument("-o", "--output", required=True, metavar="DIR", help="a new or empty folder")
    split.add_argument(
        "--balance", choices=["bytes", "time"], default="bytes",
        help="what --stages balances: stored weight bytes (default) or each call's time in `profile`",
    )
    split.add_argument(
        "--inputs", default=None, metavar="FILE.npz", help="the whole model's inputs for the test data (default: random, seed 0)"
    )
    split.add_argument(
        "--no-data", action="store_true",
        help="no test data and no check of the stages: the whole model is not run (for a model onnxruntime cannot hold)",
    )
    _json_option(split, "the stages")
    split.set_defaults(run=handlers.run_split)

    replace = commands.add_parser(
        "replace",
        parents=[common],
        help="make a block's graph the body of a class's functions or of one call",
        description="Replace the body of every function of a class, or of one call path (which then gets "
        "a function of its own), by the graph of BLOCK (e.g. an extracted model after editing). The "
        "result is checked, compared with the original in onnxruntime, and written atomically.",
    )
    replace.add_argument("model", help="the .onnx file")
    replace.add_argument("target", help="a class or function name (GPT2Block) or a module path (h.1)")
    replace.add_argument("block", help="the .onnx file whose graph becomes the body")
    replace.add_argument("-o", "--output", default=None, metavar="NEW.onnx", help="the file to write (required unless --in-place)")
    replace.add_argument("--in-place", action="store_true",
                         help="edit MODEL itself: read whole, written atomically over it (its previous data file retired after)")
    replace.add_argument(
        "--inputs", default=None, metavar="FILE.npz", help="inputs of the comparison with the original (default: random, seed 0)"
    )
    _json_option(replace, "the replacement and its drift")
    replace.set_defaults(run=handlers.run_replace)

    compare = commands.add_parser(
        "diff",
        parents=[common],
        help="compare two files module call by module call: structure, drift, time",
        description="Match the module calls of A and B by module path and class and say for each whether "
        "its structure is the same, changed (in its own body, or only below it) or only in one file; run "
        "both files on the same inputs (random from the declared types unless --inputs) and give each "
        "call's largest difference between them, the first call whose outputs differ and the calls that "
        "grow the drift most; with --profile, each call's time in both and the ratio. Exit code 0 when "
        "nothing differs, 1 when something does (as diff), 2 for bad input.",
    )
    compare.add_argument("a", metavar="A", help="the reference .onnx file")
    compare.add_argument("b", metavar="B", help="the .onnx file compared with it")
    compare.add_argument("--inputs", default=None, metavar="FILE.npz", help="inputs by name (or arr_0, arr_1, ...)")
    compare.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    compare.add_argument("--structure-only", action="store_true", help="compare the structure only (run nothing)")
    compare.add_argument("--profile", action="store_true", help="also time every call in both files")
    compare.add_argument("--runs", type=int, default=10, metavar="N", help="measured runs of --profile (default 10)")
    compare.add_argument("--threads", type=int, default=1, metavar="N",
                         help="onnxruntime intra-op threads of --profile (default 1: ratios repeat best)")
    compare.add_argument("--depth", type=_positive, default=None, metavar="N", help="show calls down to depth N")
    compare.add_argument("--top", type=_positive, default=10, metavar="N",
                         help="calls listed where the drift is made (default 10)")
    _json_option(compare, "the call records")
    compare.add_argument("--html", default=None, metavar="PATH", help="write a self-contained HTML page (the trees side by side)")
    compare.set_defaults(run=handlers.run_diff)

    conv = commands.add_parser(
        "convert",
        parents=[common],
        help="convert chosen modules to float16/bfloat16 and/or quantize their MatMul weights (int4/int8)",
        description="Convert the function bodies of a modular file: --dtype runs every module in float16 "
        "(or bfloat16) except --keep NAME; --quantize turns the MatMul weights of every module but --exclude "
        "NAME into onnxruntime's MatMulNBits (packed by onnxruntime's own quantizer). A NAME is a class "
        "(LlamaRMSNorm), a module path (model.layers.0) or a glob. The result is run in onnxruntime against "
        "the original on the same inputs, and the drift of every module call and class is reported. "
        "Index arithmetic, and (float16) values past its range on those inputs, stay float32 by themselves.",
    )
    conv.add_argument("model", help="the modular .onnx file")
    conv.add_argument("-o", "--output", required=True, metavar="NEW.onnx", help="the file to write")
    conv.add_argument("--dtype", choices=["float16", "bfloat16"], default=None, help="the precision of the converted modules")
    conv.add_argument("--keep", nargs="+", action="extend", default=[], metavar="NAME", help="modules left in float32 (with what they call)")
    conv.add_argument("--quantize", choices=["int4", "int8"], default=None, help="weight-only quantization of MatMul weights")
    conv.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="NAME", help="modules left unquantized (with what they call)")
    conv.add_argument("--block-size", type=int, default=None, metavar="N",
                      help="with --quantize: quantization block size (power of two >= 16; default 32)")
    conv.add_argument("--symmetric", action="store_true", help="symmetric quantization (no zero points)")
    conv.add_argument("--accuracy-level", type=int, default=None, metavar="L", help="MatMulNBits accuracy_level (4: int8 compute on CPU)")
    conv.add_argument(
        "--auto-keep", type=float, default=None, metavar="TOL",
        help="keep the classes that move the outputs most in float32 until every output's drift (max abs difference / range) is <= TOL; "
        "first the modules feeding a TopK/ArgMax the conversion flips; with --quantize alone, modules are left "
        "unquantized instead: those, then roles (a class's calls under one attribute), the worst first",
    )
    conv.add_argument("--inputs", default=None, metavar="FILE.npz", help="inputs of the comparison (default: random, seed 0)")
    _json_option(conv, "the report")
    conv.add_argument("--no-verify", action="store_true",
                      help="run nothing in onnxruntime (no drift report): for files larger than memory")
    conv.set_defaults(run=handlers.run_convert)

    opt = commands.add_parser(
        "optimize",
        parents=[common],
        help="rewrite module bodies into onnxruntime's fused kernels (RMS norm, skip norm, GroupQueryAttention, "
        "MultiHeadAttention, GELU, MoE)",
        description="Rewrite the function bodies of a modular decoder or encoder file into onnxruntime's fused kernels, "
        "keeping the hierarchy: RMS norms into SimplifiedLayerNormalization, residual add + norm into "
        "SkipSimplifiedLayerNormalization (SkipLayerNormalization for a LayerNorm), self-attention with a KV cache "
        "into GroupQueryAttention, attention without one (encoders, cross-attention) into MultiHeadAttention, GELU "
        "into Gelu/QuickGelu, a mixture-of-experts block (router and experts) into MoE (QMoE with --quantize). Each step runs in onnxruntime on a prompt and a decode step (an encoder: random "
        "inputs, then padded) and is kept only for the classes whose calls agree.",
    )
    opt.add_argument("model", help="the modular .onnx file (export --task causal-lm-with-past, or an encoder's)")
    opt.add_argument("-o", "--output", required=True, metavar="NEW.onnx", help="the file to write")
    opt.add_argument("--max-positions", type=_positive_int, default=None, metavar="N",
                     help="rows of the rotary caches: the longest sequence the file will run (default 4096)")
    _json_option(opt, "the report")
    opt.add_argument("--no-verify", action="store_true", help="write the rewrite without running it in onnxruntime")
    opt.add_argument("--quantize", choices=["int4", "int8", "auto"], default=None,
                     help="then quantize with onnxruntime-genai's builder recipe: MatMulNBits, block 32, symmetric, "
                     "accuracy level 4, lm_head included (convert's passes; fused experts: QMoE); auto: each call's precision (int4 "
                     "block size and rounding, int8, float) chosen from its measured KL on --calibration, within --max-size")
    opt.add_argument("--calibration", default=None, metavar="FILE",
                     help="token ids: an .npz with input_ids [n, seq] int64, or a .txt tokenized with the tokenizer.json "
                     "beside the model; needed by --quantize auto, and with int4/int8 the file is measured on them")
    opt.add_argument("--max-size", default=None, metavar="BYTES|RATIO",
                     help="with --quantize auto: the size budget, bytes (3600000, 3.6MB) or a ratio of the uniform "
                     "int4 file (1.02x); default the uniform int4 file's size")
    opt.add_argument("--accuracy-level", type=int, choices=range(5), default=None, metavar="N",
                     help="with --quantize: MatMulNBits compute, 4 = int8 (default, the builder's), 0 = float")
    opt.add_argument("--int8-lm-head", action="store_true", help="with --quantize int4: lm_head to int8 instead")
    opt.add_argument("--no-accuracy-guard", action="store_true",
                     help="with accuracy level 4: do not keep at level 0 the calls whose int8 compute flips a top token "
                     "(an encoder, with --quantize int8: do not choose per call, every call dynamic int8)")
    opt.add_argument("--inputs", default=None, metavar="FILE.npz",
                     help="an encoder's inputs by name, for the per-call choice of --quantize (default: random inputs "
                     "of the file's own shapes)")
    opt.add_argument("--int8-weight-only", action="append", default=[], metavar="MODULE",
                     help="an encoder with --quantize int8: keep this module (call path, class or glob) weight-only "
                     "int8, float compute (repeatable)")
    opt.add_argument("--int8-tolerance", type=float, default=None, metavar="X",
                     help="an encoder with --quantize: the largest relative error ||got - float|| / ||float|| of an "
                     "output before calls go weight-only (default 0.05)")
    opt.set_defaults(run=handlers.run_optimize)

    modular = commands.add_parser(
        "modularize",
        parents=[common],
        help="rebuild the module hierarchy of a flat ONNX file (torch's exporters, Optimum)",
        description="Rebuild the module calls of a flat ONNX file from what it carries: torch's "
        "pkg.torch.onnx.name_scopes and class_hierarchy (dynamo exporter), the namespace chain, or "
        "TorchScript scope names (/model/layers.0/self_attn/MatMul). Identical calls share one function. "
        "The result is compared with the flat file in onnxruntime (atol 1e-6) and written atomically.",
    )
    modular.add_argument("model", help="the flat .onnx file")
    modular.add_argument("-o", "--output", required=True, metavar="M.onnx", help="the modular file to write")
    modular.add_argument("--depth", type=_positive, default=None, metavar="D",
                         help="outline calls down to depth D only (1: the root's children; 0 = all, as for tree --depth)")
    modular.add_argument("--classes", nargs="+", default=None, metavar="NAME",
                         help="outline only calls of these classes (names or globs: GPT2Block '*Attention')")
    modular.add_argument("--no-dedupe", action="store_true", help="one function per call, even for identical calls")
    modular.add_argument(
        "--output-names", default=None, metavar="A,B,...",
        help="new names of the graph outputs, in order (torch's file names them after its last nodes: linear_28)",
    )
    modular.add_argument("--no-verify", action="store_true",
                         help="skip the comparison with the flat file (it runs both files in onnxruntime)")
    modular.add_argument(
        "--inputs", default=None, metavar="FILE.npz", help="inputs of the comparison with the flat file (default: random, seed 0)"
    )
    modular.add_argument("--infer", choices=("auto", "always", "never"), default="auto",
                         help="infer calls from repeated blocks where the file records no scopes (auto), "
                         "even where it does (always), or never (docs/modularize.md)")
    _json_option(modular, "the report")
    modular.set_defaults(run=handlers.run_modularize)

    genai = commands.add_parser(
        "genai",
        parents=[common],
        help="make an onnxruntime-genai folder from a decoder file exported with --io-names optimum",
        description="Copy a with-past decoder file (export CKPT --task causal-lm-with-past --io-names optimum, or an "
        "optimized copy) into a folder as model.onnx, write genai_config.json from its inputs and outputs and the "
        "checkpoint's config.json and generation_config.json, copy the tokenizer files, and check the folder through "
        "onnxruntime-genai's Generator against transformers' generate (greedy). docs/genai.md.",
    )
    genai.add_argument("model", help="the .onnx file (past_key_values.N.key/value in, present.N.key/value out), or a "
                       "folder split wrote from a with-cache file (genai's decoder pipeline, one stage a file)")
    genai.add_argument("--checkpoint", required=True, metavar="CKPT", help="the checkpoint folder it was exported from")
    genai.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write")
    genai.add_argument("--no-check", action="store_true", help="do not run the folder through genai")
    genai.add_argument("--steps", type=_positive, default=None, metavar="N", help="new tokens of the check (default 20)")
    genai.add_argument("--keep-on-mismatch", action="store_true", help="write the folder even when the tokens differ (exit code 1)")
    genai.add_argument("--optimize", action="store_true", help="copy in the file rewritten by `optimize` (fused kernels; GroupQueryAttention lets genai share the past and present buffers)")
    _json_option(genai, "the summary (parity, genai check, genai_config.json)")
    genai.set_defaults(run=exporting.run_genai)

    view = commands.add_parser(
        "view",
        parents=[common],
        help="open the model in Netron (served on localhost)",
        description="Serve the model with Netron (pip install netron) and open it in a browser. "
        "In Netron, click the ƒ on a call node to enter its function.",
    )
    view.add_argument("model", help="the .onnx file")
    view.add_argument("--port", type=int, default=8080, help="port to serve on (default 8080; 0: any free port)")
    view.add_argument("--host", default="localhost", help="address to serve on (default localhost)")
    view.add_argument("--no-browser", action="store_true", help="do not open a browser")
    view.add_argument(
        "--as-stored",
        action="store_true",
        help="show the file exactly as stored (by default, constants lifted out of the bodies for onnxruntime "
        "are shown back inside them, which reads like the module code)",
    )
    view.set_defaults(run=handlers.run_view)

    gen = commands.add_parser(
        "generate",
        parents=[common],
        help="greedy tokens from a with-cache file (or a --generation folder) in onnxruntime",
        description="Run a decoder exported with its cache (export --task causal-lm-with-past, converted or not) "
        "or a --generation folder (prefill.onnx + decode.onnx) greedily in onnxruntime: an empty past first, "
        "then each returned cache fed back. Prints the prompt and the new token ids (onnx_modular.generate).",
    )
    gen.add_argument("model", help="the .onnx file, the --generation folder, or a folder split wrote from a with-cache file")
    gen.add_argument(
        "--input-ids", required=True, action="append", metavar="IDS",
        help="the prompt's token ids, comma-separated (1,306,4966); repeat for a batch of equal lengths",
    )
    gen.add_argument("--max-new-tokens", type=_positive, default=20, metavar="N", help="tokens to add (default 20)")
    add_pipeline_options(gen)
    _json_option(gen, "the token ids (a split folder: {tokens, stages})")
    gen.set_defaults(run=handlers.run_generate)
    return parser
