"""Decoder flags shared by subcommands: ``--decoder NAME`` (a name in
`metaloom.decode.specs.DECODERS`) and each decoder's options."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from metaloom.errors import InvalidParameter

if TYPE_CHECKING:
    from metaloom.decode.specs import DecoderSpec
    from metaloom.models.load import LoadedModel
    from metaloom.models.protocols import LanguageModel
    from metaloom.sampling import SamplingParams

EARLY_STOPPING: dict[str, bool | str] = {"true": True, "false": False, "never": "never"}
LAYERS_PREFIX = "layers:"


def add_decoder_args(p: argparse.ArgumentParser) -> None:
    from metaloom.decode.specs import DECODERS

    p.add_argument("--decoder", default="sample", choices=sorted(DECODERS),
                   help="sample: the sampling pipeline (greedy at temperature 0); greedy; beam: beam search; "
                        "contrastive: contrastive decoding (needs --amateur-model); cfg: classifier-free guidance")
    p.add_argument("--beams", type=int, default=4, help="beam search: beam width")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search: rank by logprob / length**this")
    p.add_argument("--early-stopping", default="false", choices=sorted(EARLY_STOPPING),
                   help="beam search: stop rule (transformers' early_stopping)")
    p.add_argument("--num-beam-groups", type=int, default=1, help="diverse beam search: groups (divides --beams)")
    p.add_argument("--diversity-penalty", type=float, default=0.0, help="diverse beam search: Hamming penalty")
    p.add_argument("--amateur-model", default=None,
                   help="contrastive: 'layers:K' (the model's first K layers) or a model like --model")
    p.add_argument("--contrastive-alpha", type=float, default=0.1, help="contrastive: plausibility cut in [0, 1]")
    p.add_argument("--amateur-temperature", type=float, default=1.0, help="contrastive: amateur temperature")
    p.add_argument("--cfg-scale", type=float, default=1.5, help="cfg: guidance scale (1 = no guidance)")
    p.add_argument("--negative-prompt", default=None, help="cfg: unconditional prompt (default: the prompt's last token)")


def decoder_spec(args: argparse.Namespace, params: SamplingParams) -> tuple[SamplingParams, DecoderSpec | None]:
    """(params, decoder spec) from the flags; validates before any model is loaded."""
    from metaloom.decode.specs import DecoderOptions, build_decoder

    negative: str | tuple[dict[str, str], ...] | None = args.negative_prompt
    if args.negative_prompt is not None and not getattr(args, "raw", True):
        messages: tuple[dict[str, str], ...] = ({"role": "user", "content": args.negative_prompt},)
        if getattr(args, "system", None) is not None:
            messages = ({"role": "system", "content": args.system}, *messages)
        negative = messages
    options = DecoderOptions(
        beams=args.beams, length_penalty=args.length_penalty, early_stopping=EARLY_STOPPING[args.early_stopping],
        num_beam_groups=args.num_beam_groups, diversity_penalty=args.diversity_penalty,
        contrastive_alpha=args.contrastive_alpha, amateur_temperature=args.amateur_temperature,
        cfg_scale=args.cfg_scale, negative_prompt=negative)
    return build_decoder(args.decoder, params, options)


def amateur_model(args: argparse.Namespace, loaded: LoadedModel) -> LanguageModel | None:
    """The ``--amateur-model``: a truncation of the loaded model or another model; None if unset."""
    spec = args.amateur_model
    if spec is None:
        return None
    if spec.startswith(LAYERS_PREFIX):
        from metaloom.decode.contrastive import truncated_llama

        try:
            layers = int(spec[len(LAYERS_PREFIX):])
        except ValueError as exc:
            raise InvalidParameter("amateur_model", spec, "'layers:K' with an integer K, or a model") from exc
        return truncated_llama(loaded.model, layers)
    from metaloom.commands.common import engine_options
    from metaloom.models import load

    return load(spec, dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights,
                **engine_options(args)).model
