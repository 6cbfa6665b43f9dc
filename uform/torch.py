"""A uform checkpoint as a `torch.nn.Module`, for serving, fine-tuning or export with PyTorch's tools.

`load(path)` reads a checkpoint that `Trainer.save` wrote, whole or weights-only, and answers an
`Encoder` module computing what `uform.Encoder` computes (`docs/model.md`): pooled embeddings of
text, images, video and audio, late-interaction token vectors and choice probabilities, from the
same tokens, cut and padded as the library reads them. Text is its bytes; an image, a video or a
sound is decoded by the library itself (`uform.media_tokens`, under the checkpoint's own batch
shapes) into patches, tubelets or chunks, so this module reads the very values `uform.Encoder` reads.
Its parameters bear the checkpoint's tensor names (`state_dict()` keys are `text.embedding`,
`blocks.0.qkv`, ...), so `save(module, path)` writes a weights-only checkpoint, with the note the
module was loaded with, that `uform.Encoder.load` reads back.

The library packs items into rows and lets each attend only within itself; this module puts each
item in its own row of a padded (batch, seq) tensor and masks the padding out of attention and
pooling, so padding never changes a result. Positions restart at zero in each item, as they do in
the library: a text byte's and an audio chunk's are their index, an image patch's its (row, column)
and a video tubelet's its (time, row, column), each turning its own rotary pairs.

PyTorch is an optional extra (`pip install torch`, or `pip install ".[torch]"` from a checkout; on a machine
without a GPU, `pip install torch --index-url https://download.pytorch.org/whl/cpu` takes the CPU build):
`import uform` never imports it.
"""
from __future__ import annotations

import fcntl
import itertools
import json
import os
import stat
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as error:  # the core package works without it; only this module needs it
    raise ImportError(f"uform.torch needs PyTorch: pip install torch (the CPU build: pip install torch --index-url "
                      f"https://download.pytorch.org/whl/cpu) ({error})") from None

import numpy as np
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from . import _note_bytes, media_tokens
from .batch import wrong_count
from .config import LateInteractionSide, Modality, enum_member
from .errors import InvalidArgument, InvalidCheckpoint, StorageError, Unsupported

__all__ = ["Encoder", "Tokenized", "Packed", "Media", "load", "save", "MASK_ID", "CHOICE_ID", "QUERY_PAD_ID", "MEDIA_ID"]

MASK_ID = 256  #: Shown at masked positions in training.
CHOICE_ID = 257  #: The position after a text's content whose decoder logits choose.
QUERY_PAD_ID = 258  #: Pads a late-interaction query up to `max_query_span`.
MEDIA_ID = 259  #: A media token: an image patch, a video tubelet or an audio chunk, plus its kind's projection.
HEAD_WIDTH = 64
PAIRS = HEAD_WIDTH // 2  # rotary pairs in a head
MEDIA_KINDS = (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)  # the order of `Media`'s tuples
VOCABULARY = 260  # bytes, the three ids above and one reserved
BYTES = 256
FORMAT = "uform/1"
ENCODER_TOKENS = 16384  # the longest row `uform.Encoder` packs; a trainer refuses longer rows


class Tokenized(NamedTuple):
    """Items as the model reads them: `tokens` (batch, seq) int64 ids, padded with zeros past each
    item's `lengths` (batch,) int64, and how many items were cut to fit."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    truncated_items: int


class Media(NamedTuple):
    """The media tokens of a padded batch, which the tensor-level verbs read beside `tokens` (where
    these tokens hold `MEDIA_ID`); `Encoder.pack` builds it from encoded files, as `embed` does. The verbs
    refuse, naming the field, media that would not give each `MEDIA_ID` token within an item one value.

    `values` and `places` hold one tensor per kind, image, video and audio in that order: the tokens'
    values (count, width) as `uform.media_tokens` answers them, and where each sits, as the index
    `row * seq + position` into the flattened `tokens`. `rotary` (batch, seq, 32) int64 says which
    angle each rotary pair of each position turns by, as the index `coordinate * 32 + frequency` into
    the table of angles `coordinate * 10000^(-2 frequency / 64)`: a text byte at position p turns pair
    i by p * 32 + i, an image patch pairs 2k and 2k + 1 by its row and its column at frequency 2k, a
    video tubelet pairs 3k, 3k + 1 and 3k + 2 by its time, row and column at frequency 3k."""

    values: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    places: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    rotary: torch.Tensor


class Packed(NamedTuple):
    """Items as the tensor-level verbs read them (`Encoder.pack`): `tokens` and `lengths` as `Tokenized`'s,
    and the rows' `Media`, or None where every item is text."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    media: Optional[Media]


class _Decoded:
    """One media item as the library decodes it: its kind's index in `MEDIA_KINDS`, its tokens' values
    (count, width) and each token's rotary indices (count, 32). Its length is its tokens'."""

    __slots__ = ("kind", "values", "rotary")

    def __init__(self, kind: int, values: torch.Tensor, rotary: torch.Tensor) -> None:
        self.kind, self.values, self.rotary = kind, values, rotary

    def __len__(self) -> int:
        return len(self.values)


def _media_rotary(modality: Modality, count: int, grid: Tuple[int, int, int]) -> torch.Tensor:
    """(count, 32) rotary indices of an item's tokens, from the grid the library fitted it to (docs/model.md)."""
    _, rows, columns = grid
    token, pair = torch.arange(count)[:, None], torch.arange(PAIRS)[None, :]
    time, within = token // (rows * columns), token % (rows * columns)
    row, column = within // columns, within % columns
    if modality == Modality.IMAGE:  # each axis takes every other frequency, so both span the same scales
        return torch.where(pair % 2 == 0, row, column) * PAIRS + (pair - pair % 2)
    if modality == Modality.VIDEO:
        axis = pair % 3
        return torch.where(axis == 0, time, torch.where(axis == 1, row, column)) * PAIRS + (pair - axis)
    return token * PAIRS + pair  # an audio chunk turns as a text byte at its index


def _tracing() -> bool:
    """Whether a trace, a compilation or an export is recording the call, where tensors hold no values to read."""
    compiler = getattr(torch, "compiler", None)
    return torch.jit.is_tracing() or any(getattr(compiler, name, lambda: False)()
                                         for name in ("is_compiling", "is_exporting"))


def _rmsnorm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + 1e-6) * gain, the statistic in float32 whatever the module's dtype."""
    wide = x.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * gain


def _rope(x: torch.Tensor, cosines: torch.Tensor, sines: torch.Tensor) -> torch.Tensor:
    """Rotates each head's interleaved pairs (x[2i], x[2i+1]) of x (batch, seq, heads, 64) by the
    angles whose cosines and sines (batch or 1, seq, 32) the positions pick."""
    pairs = x.unflatten(-1, (PAIRS, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cosines, sines = cosines[:, :, None, :].to(x.dtype), sines[:, :, None, :].to(x.dtype)
    return torch.stack((even * cosines - odd * sines, even * sines + odd * cosines), dim=-1).flatten(-2)


class Block(nn.Module):
    """One pre-norm transformer block; weights are stored (out, in), as the checkpoint stores them."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads = hidden // HEAD_WIDTH
        self.attention_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Parameter(torch.empty(3 * hidden, hidden))  # rows: queries, then keys, then values
        self.out = nn.Parameter(torch.empty(hidden, hidden))
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.up = nn.Parameter(torch.empty(4 * hidden, hidden))
        self.down = nn.Parameter(torch.empty(hidden, 4 * hidden))

    def forward(self, x: torch.Tensor, keys: torch.Tensor, cosines: torch.Tensor, sines: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, hidden); keys (batch, 1, 1, seq) says which positions each item attends to;
        cosines and sines (batch or 1, seq, 32) turn each position's rotary pairs."""
        qkv = F.linear(_rmsnorm(x, self.attention_norm), self.qkv).unflatten(-1, (3, self.heads, HEAD_WIDTH))
        queries, keys_, values = qkv.unbind(2)  # each (batch, seq, heads, 64)
        queries, keys_ = _rope(queries, cosines, sines), _rope(keys_, cosines, sines)
        attended = F.scaled_dot_product_attention(queries.transpose(1, 2), keys_.transpose(1, 2),
                                                  values.transpose(1, 2), attn_mask=keys, scale=1.0 / 8.0)
        x = x + F.linear(attended.transpose(1, 2).flatten(-2), self.out)
        return x + F.linear(F.gelu(F.linear(_rmsnorm(x, self.mlp_norm), self.up), approximate="tanh"), self.down)


class _Text(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Parameter(torch.empty(VOCABULARY, hidden))
        self.decoder = nn.Parameter(torch.empty(BYTES, hidden))  # the byte decoder: masked and choice positions


class _Media(nn.Module):
    """A media kind's input projection, which adds to the `MEDIA_ID` row what a token's values say, and its
    decoder, which only masked training reads: it travels through `load` and `save` untouched."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.projection = nn.Parameter(torch.empty(hidden, width))
        self.decoder = nn.Parameter(torch.empty(width, hidden))


class _Scores(nn.Module):
    """A term's learned inverse temperatures (as logarithms) and biases, one per group."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.log_inverse_temperature = nn.Parameter(torch.zeros(groups))
        self.bias = nn.Parameter(torch.zeros(groups))


class _LateInteraction(_Scores):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__(1)
        self.token_head = nn.Parameter(torch.empty(width, hidden))


def _positive(config: dict, keys: Sequence[str], where: str, required: bool = True) -> int:
    """An integer field of the checkpoint's config, found by its path."""
    value: Any = config
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    name = ".".join(keys)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (required and value == 0):
        raise InvalidCheckpoint(f"{where} has config.{name} = {value!r}; expected a positive integer")
    return value


def _media_widths(config: dict, where: str) -> Tuple[int, int, int]:
    """Values in an image patch, a video tubelet and an audio chunk under the batch shapes the checkpoint's config
    records: a run writes each one as it derived it, so the module sizes tokens as the library's decoders do."""
    def shape(kind: str, key: str) -> int:
        return _positive(config, ("batch", kind, key), where)

    image = shape("image", "patch_side") ** 2 * shape("image", "channels")
    video = shape("video", "tube_frames") * shape("video", "patch_side") ** 2 * shape("video", "channels")
    return image, video, shape("audio", "chunk_samples")


class Encoder(nn.Module):
    """The encoder of a uform checkpoint: `load(path)` makes one.

    Tensor-level verbs take `tokens` (batch, seq) int64 ids and `lengths` (batch,) int64, each item
    in its own row, padded past its length with any id below 260, and, where rows hold media
    tokens, their `Media`; `tokenize` builds them from texts. Each item attends only within itself, so
    padding changes nothing. `seq` may not exceed the checkpoint's `max_columns_per_row`, nor an id
    leave the vocabulary, nor a length leave [1, seq]: each raises `uform.InvalidArgument` naming the
    argument (the values are read where the call runs eagerly, not under a trace or an export). Item-level
    verbs (`embed`, `embed_tokens`, `text_choose`) answer what `uform.Encoder`'s verbs of those
    names answer. Every verb follows PyTorch's grad mode: wrap inference in `torch.no_grad()` or
    `torch.inference_mode()`. `config`, `step` and `note` are what the checkpoint recorded (`note` None
    where it carried none); `save` writes them back.
    """

    def __init__(self, config: dict, step: int = 0, config_json: Optional[str] = None,
                 note: Optional[str] = None) -> None:
        super().__init__()
        where = "config"
        self.depth = _positive(config, ("depth",), where)
        self.hidden = _positive(config, ("hidden",), where)
        self.temperature_groups = _positive(config, ("contrastive", "temperature_groups"), where)
        self.max_columns_per_row = _positive(config, ("batch", "max_columns_per_row"), where)
        self.max_query_span = _positive(config, ("late_interaction", "max_query_span"), where, required=False)
        self.late_width = _positive(config, ("late_interaction", "width"), where) if self.max_query_span else 0
        self.config, self.step, self.note = config, step, note
        self.config_json = config_json if config_json is not None else json.dumps(config)
        self.text = _Text(self.hidden)
        self.image, self.video, self.audio = (_Media(self.hidden, width) for width in _media_widths(config, where))
        self.blocks = nn.ModuleList(Block(self.hidden) for _ in range(self.depth))
        self.final_norm = nn.Parameter(torch.ones(self.hidden))
        self.contrastive = _Scores(self.temperature_groups)
        self.late_interaction = _LateInteraction(self.late_width, self.hidden) if self.max_query_span else None
        # Angles in double, rounded once to float, as the library computes them: positions in the
        # thousands keep their precision.
        frequencies = torch.tensor([10000.0 ** (-2.0 * pair / HEAD_WIDTH) for pair in range(HEAD_WIDTH // 2)],
                                   dtype=torch.float64)
        angles = torch.arange(self.max_columns_per_row, dtype=torch.float64)[:, None] * frequencies
        self.register_buffer("rope_cosines", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sines", angles.sin().float(), persistent=False)

    # ------------------------------------------------------------------------------------------ #
    #  Tensor level: traceable, exportable                                                          #
    # ------------------------------------------------------------------------------------------ #

    def states(self, tokens: torch.Tensor, lengths: torch.Tensor, media: Optional[Media] = None) -> torch.Tensor:
        """The final-norm states (batch, seq, hidden) every head reads; zero past each length. `media`
        carries the batch's media tokens, where `tokens` holds any."""
        self._check_tokens(tokens, lengths, media is None)
        self._check_media(tokens, lengths, media)
        seq = tokens.shape[1]
        present = torch.arange(seq, device=tokens.device)[None, :] < lengths[:, None]  # (batch, seq)
        x = F.embedding(tokens, self.text.embedding)
        if media is None:
            cosines, sines = self.rope_cosines[None, :seq], self.rope_sines[None, :seq]
        else:
            flat = x.flatten(0, 1)
            for kind, values, places in zip((self.image, self.video, self.audio), media.values, media.places):
                flat = flat.index_add(0, places, F.linear(values.to(x.dtype), kind.projection))
            x = flat.unflatten(0, x.shape[:2])
            cosines, sines = self.rope_cosines.flatten()[media.rotary], self.rope_sines.flatten()[media.rotary]
        keys = present[:, None, None, :]
        for block in self.blocks:
            x = block(x, keys, cosines, sines)
        return _rmsnorm(x, self.final_norm) * present[..., None].to(x.dtype)

    def _check_tokens(self, tokens: Any, lengths: Any, text_alone: bool = True) -> None:
        """Refuses, naming the argument and the limit, what PyTorch would answer with an error of its own or,
        for an empty item, with NaN, and where `text_alone` (no media given) a `MEDIA_ID` within an item, which
        would be embedded as its id's row alone. The values are read only when the call runs eagerly: a trace
        or an export records the shapes alone (and bounds `seq` by its dynamic shapes)."""
        for name, value, dimensions in (("tokens", tokens, ("batch", "seq")), ("lengths", lengths, ("batch",))):
            expected = f"{name}: expected a ({', '.join(dimensions)}) tensor of int64 or int32"
            if not isinstance(value, torch.Tensor):
                raise InvalidArgument(f"{expected}, got {type(value).__name__}")
            if value.dim() != len(dimensions) or value.dtype not in (torch.int64, torch.int32):
                raise InvalidArgument(f"{expected}, got {value.dtype} of shape {tuple(value.shape)}")
        batch, seq = tokens.shape
        if lengths.shape[0] != batch:
            raise wrong_count("lengths", lengths.shape[0], batch, "one per row of tokens")
        if seq > self.max_columns_per_row:
            raise InvalidArgument(f"tokens: {seq} positions a row, over the checkpoint's max_columns_per_row = "
                                  f"{self.max_columns_per_row}")
        if _tracing() or batch == 0:
            return
        short_or_long, outside = (lengths < 1) | (lengths > seq), (tokens < 0) | (tokens >= VOCABULARY)
        unmet = (tokens == MEDIA_ID) & (torch.arange(seq, device=tokens.device)[None, :] < lengths[:, None]) \
            if text_alone else torch.zeros_like(outside)
        if not bool(short_or_long.any() | outside.any() | unmet.any()):  # one read of the device for a good call
            return
        if bool(short_or_long.any()):
            at = int(short_or_long.nonzero()[0, 0])
            raise InvalidArgument(f"lengths[{at}]: {int(lengths[at])} is not in [1, seq = {seq}]; every item has at "
                                  "least one token, and no more than its row")
        if bool(outside.any()):
            row, position = (int(k) for k in outside.nonzero()[0])
            raise InvalidArgument(f"tokens[{row}, {position}]: {int(tokens[row, position])} is not an id in "
                                  f"[0, {VOCABULARY}), the checkpoint's vocabulary (padding included)")
        row, position = (int(k) for k in unmet.nonzero()[0])
        raise InvalidArgument(f"tokens[{row}, {position}]: MEDIA_ID ({MEDIA_ID}) with no media to give its value; "
                              "`pack` builds tokens, lengths and media from items")

    def _check_media(self, tokens: torch.Tensor, lengths: torch.Tensor, media: Any) -> None:
        """Refuses media that would not give each `MEDIA_ID` token within its item one value of its kind's width,
        naming the field: left out, PyTorch would embed the id's row alone; on other tokens, in places twice or
        too few, it answers a wrong embedding without a word. Values are read as `_check_tokens` reads them."""
        batch, seq = tokens.shape
        if media is not None:
            if not isinstance(media, tuple) or len(media) != 3:
                raise InvalidArgument(f"media: expected a uform.torch.Media (values, places, rotary), got "
                                      f"{type(media).__name__}; `pack` builds one")
            values, places, rotary = media
            for field, parts in (("values", values), ("places", places)):
                if not isinstance(parts, (tuple, list)) or len(parts) != 3 or \
                        not all(isinstance(part, torch.Tensor) for part in parts):
                    raise InvalidArgument(f"media.{field}: expected 3 tensors (image, video, audio), got "
                                          f"{type(parts).__name__}")
            for k, kind in enumerate(MEDIA_KINDS):
                width = (self.image, self.video, self.audio)[k].projection.shape[1]
                if values[k].dim() != 2 or values[k].shape[1] != width or not values[k].is_floating_point():
                    raise InvalidArgument(f"media.values[{k}]: expected floats ({kind.value} tokens, {width}), got "
                                          f"{values[k].dtype} of shape {tuple(values[k].shape)}")
                if places[k].dim() != 1 or places[k].dtype != torch.int64:
                    raise InvalidArgument(f"media.places[{k}]: expected a (tokens,) tensor of int64, got "
                                          f"{places[k].dtype} of shape {tuple(places[k].shape)}")
                if len(places[k]) != len(values[k]):
                    raise wrong_count(f"media.places[{k}]", len(places[k]), len(values[k]),
                                      f"one per row of media.values[{k}]")
            if not isinstance(rotary, torch.Tensor) or tuple(rotary.shape) != (batch, seq, PAIRS) or \
                    rotary.dtype != torch.int64:
                raise InvalidArgument(f"media.rotary: expected a ({batch}, {seq}, {PAIRS}) tensor of int64, got "
                                      + (f"{rotary.dtype} of shape {tuple(rotary.shape)}" if isinstance(rotary, torch.Tensor)
                                         else type(rotary).__name__))
        if _tracing() or batch == 0 or media is None:  # MEDIA_ID with no media: `_check_tokens` refuses it
            return
        present = torch.arange(seq, device=tokens.device)[None, :] < lengths[:, None]
        wanted = ((tokens == MEDIA_ID) & present).flatten()
        given = torch.zeros_like(wanted, dtype=torch.int64)
        for k, part in enumerate(places):
            outside = (part < 0) | (part >= batch * seq)
            if bool(outside.any()):
                at = int(outside.nonzero()[0, 0])
                raise InvalidArgument(f"media.places[{k}][{at}]: {int(part[at])} is not a place in [0, batch * seq = "
                                      f"{batch * seq})")
            given = given.index_add(0, part.to(given.device), torch.ones_like(part, device=given.device))
        wrong = (given != wanted.to(torch.int64)).nonzero()
        if len(wrong):
            row, position = divmod(int(wrong[0, 0]), seq)
            count, token = int(given[wrong[0, 0]]), int(tokens[row, position])
            where = f"media.places: tokens[{row}, {position}]"
            if count == 0:
                raise InvalidArgument(f"{where} holds MEDIA_ID within its item, and no place names it")
            if count > 1:
                raise InvalidArgument(f"{where} is named by {count} places; each media token is one")
            raise InvalidArgument(f"{where} is named, but holds {token}, " + (
                "not MEDIA_ID" if token != MEDIA_ID else f"past its item's length {int(lengths[row])}"))
        outside = (rotary < 0) | (rotary >= self.rope_cosines.numel())
        if bool(outside.any()):
            row, position, pair = (int(k) for k in outside.nonzero()[0])
            raise InvalidArgument(f"media.rotary[{row}, {position}, {pair}]: {int(rotary[row, position, pair])} is not "
                                  f"an angle's index in [0, max_columns_per_row * {PAIRS} = {self.rope_cosines.numel()})")

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor, media: Optional[Media] = None) -> torch.Tensor:
        """Pooled embeddings (batch, hidden): the mean of each item's final states, unit-norm."""
        pooled = self.states(tokens, lengths, media).sum(1) / lengths[:, None].to(self.final_norm.dtype)
        return F.normalize(pooled, dim=-1)

    def token_vectors(self, tokens: torch.Tensor, lengths: torch.Tensor, media: Optional[Media] = None) -> torch.Tensor:
        """Late-interaction token vectors (batch, seq, width), each row unit-norm; zero past each length."""
        if self.late_interaction is None:
            raise InvalidArgument("encoder: this checkpoint has no token head; a run trains one with "
                                  "late_interaction.weight > 0")
        return F.normalize(F.linear(self.states(tokens, lengths, media), self.late_interaction.token_head), dim=-1)

    def choice_logits(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The byte decoder's logits (batch, 256) at each item's last position, where
        `tokenize(texts, choosing=True)` puts the choice position."""
        states = self.states(tokens, lengths)
        last = (lengths - 1).clamp(min=0)[:, None, None].expand(-1, 1, states.shape[-1])
        return F.linear(states.gather(1, last).squeeze(1), self.text.decoder)

    # ------------------------------------------------------------------------------------------ #
    #  Item level: what uform.Encoder answers                                                       #
    # ------------------------------------------------------------------------------------------ #

    def tokenize(self, texts: Sequence[Any], sides: Optional[Sequence[Any]] = None, choosing: bool = False,
                 device: Any = None) -> Tokenized:
        """Texts (str as UTF-8, or bytes) as the library reads them, on the module's device unless told.

        Plain items are cut to `max_columns_per_row` bytes. With `sides`, a query (or an item that is
        both) is cut to `max_query_span` bytes and padded up to it with `QUERY_PAD_ID`. With
        `choosing`, each text is cut one byte shorter and ends with `CHOICE_ID`, at the position of
        its content's length.
        """
        rows, truncated = self._text_rows(_contents(texts, "texts", required=True), sides, choosing)
        tokens, lengths, _ = self._pack(rows, device)
        return Tokenized(tokens, lengths, truncated)

    def pack(self, items: Sequence[Any], modalities: Optional[Sequence[Any]] = None,
             sides: Optional[Sequence[Any]] = None, device: Any = None) -> Packed:
        """Items as the tensor-level verbs read them, on the module's device unless told: `module(*packed)` is
        `embed`'s answer and `module.token_vectors(*packed)` `embed_tokens`', padded. `modalities` and `sides`
        as `embed_tokens` reads them; `media` is None where every item is text."""
        return Packed(*self._pack(self._rows(items, modalities, sides), device))

    def embed(self, items: Sequence[Any], modalities: Optional[Sequence[Any]] = None, dimensions: Optional[int] = None,
              batch_size: int = 64) -> torch.Tensor:
        """Pooled unit-norm embeddings (items, hidden) of items read as plain contents, as
        `uform.Encoder.embed` answers them; with `dimensions`, the Matryoshka prefix of that width,
        re-normalized. `modalities` (one `uform.Modality` per item) None reads every item as text (str
        as UTF-8, or bytes); an image, a video or a sound is its encoded file's bytes, decoded by the
        library under the checkpoint's batch shapes. Items run `batch_size` at a time, longest first,
        so each batch pads little."""
        trained = sorted({int(d) for d in (self.config.get("contrastive") or {}).get("matryoshka_dimensions") or ()}
                         | {self.hidden})
        if dimensions is not None and (isinstance(dimensions, bool) or dimensions not in trained):
            raise InvalidArgument(f"dimensions: {dimensions!r} is not a width this checkpoint's run trained: "
                                  f"{', '.join(map(str, trained))} (its contrastive.matryoshka_dimensions, and hidden)")
        rows = self._rows(items, modalities)
        pooled = self._batched(rows, batch_size, self.forward)
        if pooled.shape[0] == 0:
            pooled = torch.zeros((0, self.hidden), dtype=self.final_norm.dtype, device=self.final_norm.device)
        return pooled if dimensions is None else F.normalize(pooled[:, :dimensions], dim=-1)

    def embed_tokens(self, items: Sequence[Any], modalities: Optional[Sequence[Any]] = None,
                     sides: Optional[Sequence[Any]] = None, batch_size: int = 64) -> List[torch.Tensor]:
        """Each item's unit token vectors (rows, width), as `uform.Encoder.embed_tokens` answers them:
        a query (or an item that is both) answers `max_query_span` rows, a document one per byte up
        to `max_columns_per_row`, or one per patch, tubelet or chunk of an image, a video or a sound
        (only text is a query). `modalities` as `embed` reads them; `sides` None reads every item as
        a document."""
        if self.late_interaction is None:
            raise InvalidArgument("encoder: this checkpoint has no token head; a run trains one with "
                                  "late_interaction.weight > 0")
        rows = self._rows(items, modalities, sides)
        vectors = self._batched(rows, batch_size, self.token_vectors)
        return [vectors[i, :len(row)] for i, row in enumerate(rows)]

    def text_choose(self, texts: Sequence[Any], choices: Sequence[Any], batch_size: int = 64) -> List[torch.Tensor]:
        """Each text's probabilities over the bytes it may choose (str as UTF-8, or bytes; distinct, at
        least one), in the order offered, as `uform.Encoder.text_choose` answers them: the byte
        decoder's softmax at a choice position after the text, over those bytes only."""
        offered = _contents(choices, "choices")
        if len(offered) != len(texts):
            raise wrong_count("choices", len(offered), len(texts), "one per text")
        for i, entry in enumerate(offered):
            if not entry:
                raise InvalidArgument(f"choices[{i}]: empty; every text needs at least one byte to choose from")
            if len(set(entry)) != len(entry):
                twice = next(byte for k, byte in enumerate(entry) if byte in entry[:k])
                raise InvalidArgument(f"choices[{i}]: byte {twice} is offered twice")
        rows, _ = self._text_rows(_contents(texts, "texts", required=True), None, choosing=True)
        logits = self._batched(rows, batch_size, self.choice_logits)
        return [torch.softmax(logits[i, list(entry)].float(), dim=-1).to(logits.dtype)
                for i, entry in enumerate(offered)]

    def _text_rows(self, contents: List[bytes], sides: Optional[Sequence[Any]], choosing: bool):
        """Each text's ids as the library reads it (see `tokenize`), and how many were cut."""
        queries = [False] * len(contents)
        if sides is not None:
            if len(sides) != len(contents):
                raise wrong_count("sides", len(sides), len(contents), "one per text")
            queries = [_side_queries(side, f"sides[{i}]") for i, side in enumerate(sides)]
            if any(queries) and not self.max_query_span:
                raise InvalidArgument("encoder: this checkpoint has no token head, so no query span; a run trains "
                                      "one with late_interaction.weight > 0")
        rows, truncated = [], 0
        for content, query in zip(contents, queries):
            room = self.max_query_span if query else self.max_columns_per_row - (1 if choosing else 0)
            if len(content) > room:
                content, truncated = content[:room], truncated + 1
            ids = list(content)
            if query:
                ids += [QUERY_PAD_ID] * (self.max_query_span - len(ids))
            if choosing:
                ids.append(CHOICE_ID)
            rows.append(ids)
        return rows, truncated

    def _rows(self, items: Sequence[Any], modalities: Optional[Sequence[Any]],
              sides: Optional[Sequence[Any]] = None) -> list:
        """Each item as the model reads it: a text's ids, or a media item's tokens as the library decodes them."""
        if isinstance(items, (str, bytes)):
            raise InvalidArgument(f"items: expected a list of str or bytes, got one {type(items).__name__}")
        if sides is not None and len(sides) != len(items):
            raise wrong_count("sides", len(sides), len(items))
        if modalities is None:
            return self._text_rows(_contents(items, "items", required=True), sides, False)[0]
        if isinstance(modalities, (str, bytes)) or not hasattr(modalities, "__len__"):
            raise InvalidArgument(f"modalities: expected a list of Modality, got {type(modalities).__name__}")
        if len(modalities) != len(items):
            raise wrong_count("modalities", len(modalities), len(items))
        kinds = [enum_member(Modality, modality, f"modalities[{i}]") for i, modality in enumerate(modalities)]
        texts = [i for i, kind in enumerate(kinds) if kind == Modality.TEXT]
        rows: list = [None] * len(items)
        text_rows, _ = self._text_rows(_contents([items[i] for i in texts], "items", required=True, numbers=texts),
                                       None if sides is None else [sides[i] for i in texts], False)
        for i, ids in zip(texts, text_rows):
            rows[i] = ids
        for i, kind in enumerate(kinds):
            if kind != Modality.TEXT:
                rows[i] = self._decode(items[i], kind, None if sides is None else sides[i], i)
        return rows

    def _decode(self, content: Any, kind: Modality, side: Any, number: int) -> _Decoded:
        """A media item's tokens as the library decodes them under the checkpoint's batch shapes, with their
        positions."""
        if side is not None and _side_queries(side, f"sides[{number}]"):
            raise InvalidArgument(f"sides[{number}]: only text items are queries; this media item may be a document")
        if not _bytes_like(content):
            raise InvalidArgument(f"items[{number}]: expected the bytes of an encoded {kind.value} file, got "
                                  f"{type(content).__name__}")
        try:
            values, grid = media_tokens(kind, bytes(content), self.config.get("batch"))
        except (InvalidArgument, Unsupported) as error:  # `media_tokens` names its content; the caller knows it by index
            message = str(error)
            if message.startswith("content:"):
                message = f"items[{number}]" + message[len("content"):]
            raise type(error)(message) from None
        return _Decoded(MEDIA_KINDS.index(kind), torch.from_numpy(values), _media_rotary(kind, len(values), grid))

    def _pack(self, rows: list, device: Any = None):
        """Rows (text ids or decoded media) padded into (tokens, lengths, `Media` or None for text alone)."""
        device = self.final_norm.device if device is None else device
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
        seq = int(lengths.max()) if len(rows) else 0
        tokens = torch.zeros((len(rows), seq), dtype=torch.int64)
        decoded = [(i, row) for i, row in enumerate(rows) if isinstance(row, _Decoded)]
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = MEDIA_ID if isinstance(row, _Decoded) else torch.tensor(row, dtype=torch.int64)
        if not decoded:
            return tokens.to(device), lengths.to(device), None
        rotary = (torch.arange(seq)[:, None] * PAIRS + torch.arange(PAIRS)).repeat(len(rows), 1, 1)
        values, places = [], []
        for kind, module in enumerate((self.image, self.video, self.audio)):
            mine = [(i, row) for i, row in decoded if row.kind == kind]
            values.append(torch.cat([row.values for _, row in mine]) if mine
                          else torch.zeros((0, module.projection.shape[1])))
            places.append(torch.cat([i * seq + torch.arange(len(row)) for i, row in mine]) if mine
                          else torch.zeros((0,), dtype=torch.int64))
            for i, row in mine:
                rotary[i, :len(row)] = row.rotary
        media = Media(tuple(v.to(device) for v in values), tuple(p.to(device) for p in places), rotary.to(device))
        return tokens.to(device), lengths.to(device), media

    def _batched(self, rows: list, batch_size: int, verb: Any) -> torch.Tensor:
        """Runs `verb` over `batch_size` rows at a time, longest first, and answers its rows in item
        order, padded to the longest item where they have a sequence axis."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgument(f"batch_size: {batch_size!r} is not a positive int")
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
        order = torch.argsort(lengths, descending=True, stable=True)
        longest = int(lengths.max()) if len(rows) else 0
        parts = []
        for first in range(0, len(order), batch_size):
            tokens, chosen, media = self._pack([rows[i] for i in order[first:first + batch_size].tolist()])
            answer = verb(tokens, chosen) if media is None else verb(tokens, chosen, media)
            if answer.dim() == 3 and answer.shape[1] < longest:
                answer = F.pad(answer, (0, 0, 0, longest - answer.shape[1]))
            parts.append(answer)
        if not parts:
            return torch.zeros((0,), dtype=self.final_norm.dtype, device=self.final_norm.device)
        joined = torch.cat(parts)
        return joined[torch.argsort(order).to(joined.device)]


def _contents(entries: Any, path: str, required: bool = False,
              numbers: Optional[Sequence[int]] = None) -> List[bytes]:
    """Texts as bytes: a str is its UTF-8; with `required`, each needs at least one byte, as the library
    asks. `numbers` are the entries' indices in messages where they were picked from a longer list."""
    if isinstance(entries, (str, bytes)):
        raise InvalidArgument(f"{path}: expected a list of str or bytes, got one {type(entries).__name__}")
    contents = []
    for i, entry in (enumerate(entries) if numbers is None else zip(numbers, entries)):
        if isinstance(entry, str):
            try:
                entry = entry.encode("utf-8")
            except UnicodeEncodeError as error:
                raise InvalidArgument(f"{path}[{i}]: cannot be encoded as UTF-8 ({error.reason})") from None
        elif _bytes_like(entry):
            entry = bytes(entry)
        else:
            raise InvalidArgument(f"{path}[{i}]: expected str or bytes, got {type(entry).__name__}")
        if required and not entry:
            raise InvalidArgument(f"{path}[{i}]: empty; every item needs at least one byte")
        contents.append(entry)
    return contents


def _bytes_like(entry: Any) -> bool:
    """Bytes, as `uform.Encoder` takes them: bytes, a bytearray, a memoryview or a numpy array of uint8."""
    return isinstance(entry, (bytes, bytearray, memoryview)) or (
        isinstance(entry, np.ndarray) and entry.dtype == np.uint8 and entry.ndim == 1)


def _path(path: Any) -> str:
    """A path as str, from str, bytes or an `os.PathLike`; anything else refused by name."""
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise InvalidArgument(f"path: expected a str, bytes or os.PathLike, got {type(path).__name__}") from None


def _side_queries(side: Any, path: str) -> bool:
    member = enum_member(LateInteractionSide, side, path)
    if member == LateInteractionSide.NONE:
        raise InvalidArgument(f"{path}: none has no token vectors; read an item as a query, a document or both")
    return member in (LateInteractionSide.QUERY, LateInteractionSide.QUERY_AND_DOCUMENT)


def _read_metadata(where: str, metadata: dict):
    """The checkpoint's config (parsed and as written), step, kind and note, each checked as the library checks it."""
    if metadata.get("format") != FORMAT:
        raise InvalidCheckpoint(f"{where} has __metadata__.format = {metadata.get('format')!r}, not {FORMAT!r}")
    step = metadata.get("step")
    if not isinstance(step, str) or not step.isdigit() or not step.isascii() or int(step) >= 2 ** 63:
        raise InvalidCheckpoint(f"{where} has __metadata__.step = {step!r}, not a decimal below 2^63")
    weights_only = metadata.get("weights_only", "false")
    if weights_only not in ("true", "false"):
        raise InvalidCheckpoint(f"{where} has __metadata__.weights_only = {weights_only!r}, not \"true\" or \"false\"")
    text = metadata.get("config")
    try:
        config = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError as error:
        raise InvalidCheckpoint(f"{where} has a malformed __metadata__.config: {error}") from None
    if not isinstance(config, dict):
        raise InvalidCheckpoint(f"{where} lacks a JSON object in __metadata__.config")
    hidden = _positive(config, ("hidden",), where)
    _positive(config, ("depth",), where)
    _positive(config, ("contrastive", "temperature_groups"), where)
    if hidden % 128:
        raise InvalidCheckpoint(f"{where} has config.hidden = {hidden}, not a multiple of 128")
    columns = _positive(config, ("batch", "max_columns_per_row"), where)
    if columns > ENCODER_TOKENS:
        raise InvalidCheckpoint(f"{where} records config.batch.max_columns_per_row = {columns}; an encoder packs at "
                                f"most {ENCODER_TOKENS} tokens a pass")
    _media_widths(config, where)
    span = _positive(config, ("late_interaction", "max_query_span"), where, required=False)
    if span:
        width = _positive(config, ("late_interaction", "width"), where)
        if width % 8 or span > columns:
            raise InvalidCheckpoint(f"{where} has config.late_interaction.width = {width} and max_query_span = {span}; "
                                    f"a run takes a width that is a multiple of 8 and a span that fits a row")
    return config, text, int(step), weights_only == "true", metadata.get("note") or None


def _check_names(where: str, names: Sequence[str], expected: dict, weights_only: bool) -> None:
    """Every tensor the module needs is there; anything else is a moment the file's kind allows, or refused by name."""
    present = set(names)
    for name in expected:
        if name not in present:
            raise InvalidCheckpoint(f"{where} lacks the tensor {name}")
    for name in sorted(present - set(expected)):
        family, _, weight = name.partition(".")
        if family == "adamw" and not weights_only:
            kind, _, weight = weight.partition(".")
            if kind in ("first", "second") and weight in expected:
                continue
        if weights_only and family == "adamw":
            raise InvalidCheckpoint(f"{where} says __metadata__.weights_only is \"true\" yet holds the moment {name}")
        raise InvalidCheckpoint(f"{where} holds the tensor {name}, which uform.torch does not implement")
    if not weights_only:
        for name in expected:
            for kind in ("first", "second"):
                if f"adamw.{kind}.{name}" not in present:
                    raise InvalidCheckpoint(f"{where} is a whole checkpoint (no weights_only mark) yet lacks "
                                            f"the moment adamw.{kind}.{name}")


def _check_opens(name: Any) -> None:
    """A file that cannot be read raises `StorageError`, as the library's readers (`uform.Encoder.load`,
    `uform.checkpoint_note`) raise it, with their words; what it holds is judged after."""
    try:
        descriptor = os.open(name, os.O_RDONLY)
    except OSError as error:
        raise StorageError(f"path: cannot open {os.fsdecode(name)}: {error.strerror}") from None
    try:
        regular = stat.S_ISREG(os.fstat(descriptor).st_mode)
    finally:
        os.close(descriptor)
    if not regular:
        raise StorageError(f"path: {os.fsdecode(name)} is not a regular file")


def load(path: Any, device: Any = None, dtype: Optional[torch.dtype] = None) -> Encoder:
    """Reads a checkpoint written by `Trainer.save` (whole or weights-only) into an `Encoder` module,
    in eval mode, on `device` (default CPU) in `dtype` (default float32, the checkpoint's own).

    Only the weights are read. The file's config and tensors are checked as `uform.Encoder.load`
    checks them, and anything this module does not implement (another modality's weights, an
    unknown head) is refused by name: `uform.InvalidCheckpoint` or `uform.Unsupported`. A file that
    cannot be opened, or is no regular file, raises `uform.StorageError`, as `uform.Encoder.load` does.
    """
    path = _path(path)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgument(f"dtype: expected a floating torch.dtype (torch.float32, torch.bfloat16, ...), got {dtype!r}")
    where = f"path: {path}"
    _check_opens(path)
    try:
        opened = safe_open(path, framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own types for unreadable headers
        raise InvalidCheckpoint(f"{where} is not a readable safetensors file ({error})") from None
    with opened as file:
        config, text, step, weights_only, note = _read_metadata(where, file.metadata() or {})
        module = Encoder(config, step=step, config_json=text, note=note)
        expected = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
        _check_names(where, list(file.keys()), expected, weights_only)
        state = {}
        for name, shape in expected.items():
            stored = file.get_slice(name)
            if stored.get_dtype() != "F32" or tuple(stored.get_shape()) != shape:
                raise InvalidCheckpoint(f"{where} holds {name} as {stored.get_dtype()} {list(stored.get_shape())}, "
                                        f"the model needs F32 {list(shape)}")
            tensor = file.get_tensor(name)
            if not torch.isfinite(tensor).all():
                raise InvalidCheckpoint(f"{where} holds a non-finite value in {name}")
            state[name] = tensor
    module.load_state_dict(state)
    return module.to(device=device, dtype=dtype).eval()


_KEEP = object()  # `save`'s note when none is given: the module's own


def save(module: Encoder, path: Any, note: Any = _KEEP) -> None:
    """Writes `module`'s weights as a weights-only uform checkpoint (float32, the config, step and note it was
    loaded with), which `uform.Encoder.load` and `uform.torch.load` read; no run resumes from it.

    `note` replaces the module's note (`module.note`, which `load` read from the checkpoint's
    `__metadata__.note`), as `Trainer.save(path, note=...)` stores one, refused as it refuses one (over
    `uform.MAX_NOTE_BYTES`, say); None or "" stores none. `uform.checkpoint_note(path)` reads it back.

    A tensor the config does not make or of a shape it does not need, or a value that is not a finite
    float32, raises `uform.InvalidArgument` naming it, and nothing is written. The file is written beside
    `path` and renamed into place, with the mode `Trainer.save` gives (0644 less the umask); a path that
    cannot be written raises `uform.StorageError` naming it, as `Trainer.save` does."""
    if not isinstance(module, Encoder):
        raise InvalidArgument(f"module: expected a uform.torch.Encoder, got {type(module).__name__}")
    path = _path(path)
    if os.path.isdir(path):
        raise InvalidArgument(f"path: {path} names a folder, not a file")
    if _whole(path):
        raise InvalidArgument(f"path: {path} holds a whole checkpoint, from which a run resumes; this weights-only "
                              "save would lose its moments: save elsewhere, or remove it first")
    note = module.note if note is _KEEP else note
    tensors = _checked_tensors(module)
    metadata = {"format": FORMAT, "step": str(module.step), "config": module.config_json, "weights_only": "true"}
    if note is not None and _note_bytes(note):
        metadata["note"] = note
    _write_in_place(path, save_tensors(tensors, metadata=metadata))


def _whole(path: str) -> bool:
    """Whether `path` holds a uform checkpoint that is not weights-only (one a run resumes from)."""
    if not os.path.isfile(path):  # a pipe or a device is never opened to find out
        return False
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            metadata = file.metadata() or {}
    except Exception:  # absent or unreadable: nothing of a run's to lose
        return False
    return metadata.get("format") == FORMAT and metadata.get("weights_only") != "true"


def _checked_tensors(module: Encoder) -> dict:
    """The module's tensors as float32 on the CPU, refused (`InvalidArgument`, by name) where `load` and
    `uform.Encoder.load` would refuse the file: a tensor its config does not make, a shape it does not
    need, a value that is not a finite float32. Judged before anything is written."""
    with torch.device("meta"):  # the names and shapes `load` expects of this config, without their memory
        expected = {name: tuple(tensor.shape)
                    for name, tensor in Encoder(json.loads(module.config_json)).state_dict().items()}
    state = module.state_dict()
    for name in state:
        if name not in expected:
            raise InvalidArgument(f"module: holds the tensor {name}, which its config does not make; a checkpoint "
                                  "holding it is refused")
    tensors = {}
    for name, shape in expected.items():
        if name not in state:
            raise InvalidArgument(f"module: lacks the tensor {name}, which its config needs")
        tensor = state[name].detach()
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(f"module: {name} has shape {list(tensor.shape)}, its config needs {list(shape)}")
        stored = tensor.to("cpu", torch.float32).contiguous()
        bad = (~torch.isfinite(stored)).nonzero()
        if len(bad):  # the value as the module holds it, before the cast made it inf
            at = tuple(bad[0].tolist())
            raise InvalidArgument(f"module: {name}[{', '.join(map(str, at))}] = {tensor[at].item()!r} is not a finite "
                                  "float32; a checkpoint holds only finite values")
        tensors[name] = stored
    return tensors


_saves_started = itertools.count()  # with the PID, makes every temporary name unique, as the library's are


def _write_in_place(path: str, data: bytes) -> None:
    """Writes `data` as `Trainer.save` writes a checkpoint: into `.NAME.PID.N.partial` beside `path`, created
    exclusively with mode 0644 less the umask, locked (so the library's sweep of dead writers' leftovers
    passes it by), then renamed over it, so a crash keeps the previous file. Failures raise `StorageError`
    naming `path`."""
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.{next(_saves_started)}.partial")
    created = False
    try:
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), "wb") as file:
            created = True
            try:
                fcntl.lockf(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # where locks are not supported, the PID alone guards the file
                pass
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:  # an interrupt too leaves no partial file behind
        if created:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        if isinstance(error, OSError):
            raise StorageError(f"path: cannot write {path}: {error.strerror}") from None
        raise
    try:  # the rename is durable once the folder's entry is: best effort, as the library's
        directory = os.open(folder or ".", os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError:
        pass
