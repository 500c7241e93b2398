"""Images and audio clips in chat requests, on the router: the operator's limits, refusing them for a
model that takes none (or the other kind), undecodable bytes named by the part that carried them, and
the rendered prompt's placeholders expanded to each one's token count (so admission, the context
limit and usage all count their tokens). The workers get the expanded ids plus the media themselves.
--max-images and --max-image-bytes bound audio clips as they bound images.
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.models.audio import AudioInput, AudioPlaceholders
from baton.models.multimodal import ImageInput, ImagePlaceholders, MediaInput
from baton.v1 import router_pb2

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_BYTES = 6 << 20
# every image of a request travels in one gRPC message to the prefill worker (64 MiB at most)
MAX_IMAGE_BYTES_PER_REQUEST = 56 << 20
NOUNS = {"image": "images", "audio": "audio clips", None: "images"}


@dataclass(frozen=True, slots=True)
class ChatImage:
    image: MediaInput               # an image, or an audio clip (models that take audio)
    part: str                       # where the client put it, for error messages: "chat.messages[1].parts[0]"

    def to_proto(self) -> router_pb2.Image | router_pb2.Audio:
        if isinstance(self.image, AudioInput):
            return router_pb2.Audio(data=self.image.data, format=self.image.format)
        return router_pb2.Image(data=self.image.data, mime_type=self.image.mime_type)


def by_kind(media: list[ChatImage]) -> tuple[list[router_pb2.Image], list[router_pb2.Audio]]:
    """The worker request's `images` and `audios` fields."""
    protos = [c.to_proto() for c in media]
    return ([p for p in protos if isinstance(p, router_pb2.Image)],
            [p for p in protos if isinstance(p, router_pb2.Audio)])


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """One router's rules for images and audio: its model's placeholders (None: a text-only model) and limits."""
    model: str
    vision: ImagePlaceholders | AudioPlaceholders | None = None
    max_images: int = DEFAULT_MAX_IMAGES            # per request (0: images refused)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # per encoded image

    def collect(self, req: router_pb2.GenerateRequest) -> list[ChatImage]:
        """The request's images (or audio clips) in prompt order, each checked against the limits and
        the kind the model takes (nothing decoded yet)."""
        if req.WhichOneof("input") != "chat":
            return []
        parts = [(p, f"chat.messages[{i}].parts[{j}]") for i, m in enumerate(req.chat.messages)
                 for j, p in enumerate(m.parts) if p.WhichOneof("part") in ("image", "audio")]
        taken = self.vision.kind if self.vision is not None else None
        for p, where in parts:
            kind = p.WhichOneof("part")
            if kind != taken:
                raise ValueError(f"model {self.model} takes no {'images' if kind == 'image' else 'audio'} ({where} is "
                                 "one): send text only" + ("" if taken is None else f" or {taken} parts"))
        if len(parts) > self.max_images:
            raise ValueError(f"the chat has {len(parts)} {NOUNS[taken]}; this server accepts at most "
                             f"{self.max_images} per request (--max-images)")
        return [self._checked(p, where) for p, where in parts]

    def _checked(self, part: router_pb2.ChatContentPart, where: str) -> ChatImage:
        media = part.image if part.HasField("image") else part.audio
        noun = "image" if part.HasField("image") else "audio clip"
        if not media.data:
            raise ValueError(f"{where}: the {noun} has no bytes")
        if len(media.data) > self.max_image_bytes:
            raise ValueError(f"{where}: the {noun} is {len(media.data)} bytes; this server accepts at most "
                             f"{self.max_image_bytes} per {noun} (--max-image-bytes)")
        try:
            if part.HasField("image"):
                return ChatImage(ImageInput(media.data, media.mime_type), where)
            return ChatImage(AudioInput(media.data, media.format.lower()), where)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def measure(self, images: list[ChatImage]) -> None:
        """Decode each image once (its size sets its token count); a bad one is named by its part.
        Slow for big images: the router runs it off its event loop."""
        for k, c in enumerate(images):
            try:
                self.vision.num_tokens(c.image, k)
            except ValueError as exc:
                raise ValueError(f"{c.part}: {exc}") from None

    def expand(self, ids: list[int], images: list[ChatImage]) -> list[int]:
        """The rendered prompt with each image's single placeholder grown to its token count.
        Without images, a placeholder token in the prompt (typed as text or token ids) is refused:
        the engine would have no image to put there."""
        if self.vision is None:
            return ids
        if images:
            return self.vision.expand(ids, [c.image for c in images])
        if self.vision.token_id in ids:
            kind = self.vision.kind
            raise ValueError(f"the prompt holds the {kind} placeholder token {self.vision.token_id} but no "
                             f"{NOUNS[kind][:-1]}: send {NOUNS[kind]} as chat {kind} parts")
        return ids


def check_limits(max_images: int, max_image_bytes: int) -> None:
    """The flags' own sanity (RouterConfig.validate)."""
    if max_images < 0 or max_image_bytes < 1:
        raise ValueError("--max-images must be >= 0 and --max-image-bytes >= 1")
    if max_images * max_image_bytes > MAX_IMAGE_BYTES_PER_REQUEST:
        raise ValueError(f"--max-images x --max-image-bytes is {max_images * max_image_bytes} bytes; a request's "
                         f"images must fit in {MAX_IMAGE_BYTES_PER_REQUEST} (one gRPC message to the prefill worker)")
