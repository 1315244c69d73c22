"""Procedural image-edit examples: flat-coloured shapes on a plain background, changed by a short instruction.

They let a new user build a cache and train with no downloads. Sample `i` is a pure function of
`(seed, i)`, so any slice of a `DemoSource` can be generated on its own and always comes out the same.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from PIL import Image, ImageDraw

from .records import RawEditSample

# (W, H) in pixels. Multiples of 16 keep latent grids whole; three shapes give three buckets per context layout.
SCENE_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (96, 64), (64, 96))
# The object card of an insert edit is square whatever the scene, so context sizes can differ from the target.
CARD_SIZE: tuple[int, int] = (64, 64)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 165, 60),
    "blue": (40, 80, 215),
    "yellow": (235, 200, 40),
    "purple": (135, 60, 175),
    "orange": (240, 130, 30),
}
BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((235, 235, 230), (195, 200, 210), (40, 45, 55), (245, 228, 200))
# Share of two-context (insert) samples; the rest split evenly over the single-context edits.
INSERT_FRACTION = 0.25
MIN_RADIUS, MAX_RADIUS = 7, 13
_MARGIN = 2  # free pixels kept between shapes and around the frame, so edits never touch or clip a shape


@dataclass(frozen=True)
class _Shape:
    kind: str
    colour: str
    x: int  # centre
    y: int
    r: int  # half the side of the bounding box

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass(frozen=True)
class _Edit:
    kind: str
    before: list[_Shape]
    after: list[_Shape]
    instruction: str
    subject: str


def _fits(shape: _Shape, size: tuple[int, int], others: list[_Shape]) -> bool:
    """Whether `shape` lies inside the frame and keeps its bounding box clear of every other shape."""
    width, height = size
    if not (_MARGIN + shape.r <= shape.x <= width - _MARGIN - shape.r):
        return False
    if not (_MARGIN + shape.r <= shape.y <= height - _MARGIN - shape.r):
        return False
    reach = shape.r + _MARGIN
    return all(max(abs(shape.x - o.x), abs(shape.y - o.y)) >= reach + o.r for o in others)


def _place(rng: random.Random, kind: str, colour: str, size: tuple[int, int], others: list[_Shape]) -> _Shape | None:
    """A random free position for a new shape, or None when a few tries find no room (never in an empty frame)."""
    for _ in range(20):
        r = rng.randint(MIN_RADIUS, MAX_RADIUS)
        low = r + _MARGIN
        shape = _Shape(kind, colour, rng.randint(low, size[0] - low), rng.randint(low, size[1] - low), r)
        if _fits(shape, size, others):
            return shape
    return None


def _scene(rng: random.Random, size: tuple[int, int], count: int, taken: list[_Shape]) -> list[_Shape]:
    """Up to `count` shapes, each (kind, colour) pair distinct from each other and from `taken`."""
    used = {(s.kind, s.colour) for s in taken}
    pairs = [(k, c) for k in SHAPES for c in COLOURS if (k, c) not in used]
    shapes: list[_Shape] = []
    for kind, colour in rng.sample(pairs, count):
        shape = _place(rng, kind, colour, size, taken + shapes)
        if shape is not None:
            shapes.append(shape)
    return shapes


def _refer(rng: random.Random, shape: _Shape, scene: list[_Shape]) -> str:
    """A phrase naming `shape` unambiguously; the colour is optional when its kind is unique in the scene."""
    unique = sum(s.kind == shape.kind for s in scene) == 1
    return f"the {shape.kind}" if unique and rng.random() < 0.5 else f"the {shape.name}"


def _swap(scene: list[_Shape], old: _Shape, new: _Shape) -> list[_Shape]:
    return [new if s == old else s for s in scene]


def _recolor(rng: random.Random, size: tuple[int, int], scene: list[_Shape]) -> _Edit:
    shape = rng.choice(scene)
    used = {(s.kind, s.colour) for s in scene}
    colour = rng.choice([c for c in COLOURS if (shape.kind, c) not in used])
    template = rng.choice(("make {} {}", "turn {} {}", "change {} to {}"))
    instruction = template.format(_refer(rng, shape, scene), colour)
    return _Edit("recolor", scene, _swap(scene, shape, replace(shape, colour=colour)), instruction, shape.name)


def _move(rng: random.Random, size: tuple[int, int], scene: list[_Shape]) -> _Edit | None:
    shape = rng.choice(scene)
    others = [s for s in scene if s != shape]
    step = rng.randint(12, 24)
    moves = {"left": (-step, 0), "right": (step, 0), "up": (0, -step), "down": (0, step)}
    options = [(word, replace(shape, x=shape.x + dx, y=shape.y + dy)) for word, (dx, dy) in moves.items()]
    options = [(word, moved) for word, moved in options if _fits(moved, size, others)]
    if not options:
        return None
    word, moved = rng.choice(options)
    instruction = f"move {_refer(rng, shape, scene)} {word}"
    return _Edit("move", scene, _swap(scene, shape, moved), instruction, shape.name)


def _remove(rng: random.Random, size: tuple[int, int], scene: list[_Shape]) -> _Edit | None:
    shape = rng.choice(scene)
    verb = rng.choice(("remove", "delete", "take away"))
    instruction = f"{verb} {_refer(rng, shape, scene)}"
    return _Edit("remove", scene, [s for s in scene if s != shape], instruction, shape.name)


def _resize(rng: random.Random, size: tuple[int, int], scene: list[_Shape]) -> _Edit | None:
    shape = rng.choice(scene)
    others = [s for s in scene if s != shape]
    bigger = replace(shape, r=round(shape.r * 1.5))
    smaller = replace(shape, r=max(4, round(shape.r / 1.5)))
    if _fits(bigger, size, others) and rng.random() < 0.5:
        word, resized = "bigger", bigger
    else:
        word, resized = "smaller", smaller
    instruction = f"make {_refer(rng, shape, scene)} {word}"
    return _Edit("resize", scene, _swap(scene, shape, resized), instruction, shape.name)


_SINGLE_EDITS: tuple[Callable[[random.Random, tuple[int, int], list[_Shape]], _Edit | None], ...] = (
    _recolor,
    _move,
    _remove,
    _resize,
)


def _where(shape: _Shape, size: tuple[int, int]) -> str:
    """A coarse location such as 'at the top left' or 'in the middle', from the frame's thirds."""
    column = ("left", "", "right")[min(2, 3 * shape.x // size[0])]
    row = ("top", "", "bottom")[min(2, 3 * shape.y // size[1])]
    if row and column:
        return f"at the {row} {column}"
    if row or column:
        return f"{'on' if column else 'at'} the {row or column}"
    return "in the middle"


def _draw(size: tuple[int, int], background: tuple[int, int, int], shapes: list[_Shape]) -> Image.Image:
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    for s in shapes:
        fill = COLOURS[s.colour]
        box = (s.x - s.r, s.y - s.r, s.x + s.r - 1, s.y + s.r - 1)
        if s.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif s.kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(s.x, s.y - s.r), (s.x + s.r - 1, s.y + s.r - 1), (s.x - s.r, s.y + s.r - 1)], fill=fill)
    return image


class DemoSource:
    """`num_samples` procedural edit examples; sample `i` depends only on `(seed, i)`.

    Single-context edits recolor, move, remove or resize one shape (context and target share one
    size); insert edits (about a quarter) add the shape from a square second context to the scene.
    """

    def __init__(self, num_samples: int = 2000, seed: int = 0) -> None:
        """Describe the source; nothing is generated until a sample is asked for.

        Args:
            num_samples: How many examples the source holds.
            seed: Picks a different, equally reproducible set of examples.
        """
        if num_samples < 0:
            raise ValueError(f"DemoSource: num_samples: expected a count >= 0, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[RawEditSample]:
        return (self[i] for i in range(self.num_samples))

    def __getitem__(self, index: int) -> RawEditSample:
        i = operator.index(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"DemoSource: index {index} is out of range for {self.num_samples} samples")
        # String seeds are hashed with SHA-512 by `random`, so streams are stable across runs and platforms.
        rng = random.Random(f"image-edit-demo:{self.seed}:{i}")
        size = rng.choice(SCENE_SIZES)
        background = rng.choice(BACKGROUNDS)
        metadata = {"source": "demo", "seed": self.seed, "index": i}
        if rng.random() < INSERT_FRACTION:
            return self._insert(rng, f"demo-{i:06d}", size, background, metadata)
        scene = _scene(rng, size, rng.randint(1, 3), [])
        # Recolor always applies (6 colours, at most 3 shapes), so it stands in when a move finds no room.
        edit = rng.choice(_SINGLE_EDITS)(rng, size, scene) or _recolor(rng, size, scene)
        return RawEditSample(
            sample_id=f"demo-{i:06d}",
            prompt=edit.instruction,
            target=_draw(size, background, edit.after),
            contexts=(_draw(size, background, edit.before),),
            metadata={**metadata, "edit": edit.kind, "subject": edit.subject},
        )

    @staticmethod
    def _insert(
        rng: random.Random,
        sample_id: str,
        size: tuple[int, int],
        background: tuple[int, int, int],
        metadata: dict[str, object],
    ) -> RawEditSample:
        """Context 1 is the scene, context 2 a lone shape on its own card; the target has it in the scene."""
        # The inserted shape is placed first so there is always room for it; the scene fills in around it.
        kind, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        added = _place(rng, kind, colour, size, []) or _Shape(kind, colour, size[0] // 2, size[1] // 2, MIN_RADIUS)
        scene = _scene(rng, size, rng.randint(0, 2), [added])
        card_background = rng.choice([b for b in BACKGROUNDS if b != background])
        card = replace(added, x=CARD_SIZE[0] // 2, y=CARD_SIZE[1] // 2)
        template = rng.choice(
            (
                "put the shape from the second image into the first, {where}",
                "add the {name} from the second image to the first, {where}",
            )
        )
        return RawEditSample(
            sample_id=sample_id,
            prompt=template.format(name=added.name, where=_where(added, size)),
            target=_draw(size, background, [*scene, added]),
            contexts=(_draw(size, background, scene), _draw(CARD_SIZE, card_background, [card])),
            metadata={**metadata, "edit": "insert", "subject": added.name},
        )
