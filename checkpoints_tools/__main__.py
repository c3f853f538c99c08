"""``python -m checkpoints_tools {convert,inspect,verify}``: convert checkpoints to orbax, show what
a checkpoint holds, and check its logits against Hugging Face transformers."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 verify over tolerance, 2 bad input)."""
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="GGUF / HF safetensors -> orbax, streaming tensor by tensor")
    c.add_argument("src", help="source: .gguf file, known model name (smollm2-135m, gemma3-270m) or HF directory")
    c.add_argument("--from", dest="src_format", required=True, choices=["gguf", "hf"])
    c.add_argument("--to", dest="dst_format", default="orbax", choices=["orbax"])
    c.add_argument("dst", help="destination orbax directory (must not exist unless --overwrite)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    i = sub.add_parser("inspect", help="architecture, shapes, dtypes, parameter count, bytes")
    i.add_argument("path")
    i.add_argument("--all", action="store_true", help="list every tensor, not only the first layer's")
    v = sub.add_parser("verify", help="jaxspec logits vs transformers on fixed prompts")
    v.add_argument("path")
    v.add_argument("--reference", default="transformers", choices=["transformers"])
    v.add_argument("--atol", type=float, default=None, help="exit 1 when the max absolute error exceeds this")
    args = parser.parse_args(argv)

    try:
        if args.command == "convert":
            from checkpoints_tools.convert import convert

            r = convert(args.src_format, args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
            print(f"wrote {r['dst']}: {r['config']}, {r['n_params']:,} parameters, {r['bytes'] / 2**20:.1f} MiB "
                  f"{args.dtype}, {r['seconds']:.1f} s, peak host memory (RSS) {r['peak_rss_mb']:.0f} MiB")
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


if __name__ == "__main__":
    sys.exit(main())
