"""Images in chat requests, on the router: the operator's limits, refusing them for a model that
takes none, undecodable bytes named by the part that carried them, and the rendered prompt's
image placeholders expanded to each image's token count (so admission, the context limit and
usage all count image tokens). The workers get the expanded ids plus the images themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.models.multimodal import ImageInput, ImagePlaceholders
from baton.v1 import router_pb2

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_BYTES = 6 << 20
# every image of a request travels in one gRPC message to the prefill worker (64 MiB at most)
MAX_IMAGE_BYTES_PER_REQUEST = 56 << 20


@dataclass(frozen=True, slots=True)
class ChatImage:
    image: ImageInput
    part: str                       # where the client put it, for error messages: "chat.messages[1].parts[0]"

    def to_proto(self) -> router_pb2.Image:
        return router_pb2.Image(data=self.image.data, mime_type=self.image.mime_type)


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """One router's rules for images: its model's placeholders (None: a text-only model) and limits."""
    model: str
    vision: ImagePlaceholders | None = None
    max_images: int = DEFAULT_MAX_IMAGES            # per request (0: images refused)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # per encoded image

    def collect(self, req: router_pb2.GenerateRequest) -> list[ChatImage]:
        """The request's images in prompt order, each checked against the limits (nothing decoded yet)."""
        if req.WhichOneof("input") != "chat":
            return []
        parts = [(p.image, f"chat.messages[{i}].parts[{j}]") for i, m in enumerate(req.chat.messages)
                 for j, p in enumerate(m.parts) if p.WhichOneof("part") == "image"]
        if parts and self.vision is None:
            raise ValueError(f"model {self.model} takes no images ({parts[0][1]} is one): send text only")
        if len(parts) > self.max_images:
            raise ValueError(f"the chat has {len(parts)} images; this server accepts at most {self.max_images} "
                             "per request (--max-images)")
        return [self._checked(image, part) for image, part in parts]

    def _checked(self, image: router_pb2.Image, part: str) -> ChatImage:
        if not image.data:
            raise ValueError(f"{part}: the image has no bytes")
        if len(image.data) > self.max_image_bytes:
            raise ValueError(f"{part}: the image is {len(image.data)} bytes; this server accepts at most "
                             f"{self.max_image_bytes} per image (--max-image-bytes)")
        return ChatImage(ImageInput(image.data, image.mime_type), part)

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
        if self.vision.image_token_id in ids:
            raise ValueError(f"the prompt holds the image placeholder token {self.vision.image_token_id} but "
                             "no image: send images as chat image parts")
        return ids


def check_limits(max_images: int, max_image_bytes: int) -> None:
    """The flags' own sanity (RouterConfig.validate)."""
    if max_images < 0 or max_image_bytes < 1:
        raise ValueError("--max-images must be >= 0 and --max-image-bytes >= 1")
    if max_images * max_image_bytes > MAX_IMAGE_BYTES_PER_REQUEST:
        raise ValueError(f"--max-images x --max-image-bytes is {max_images * max_image_bytes} bytes; a request's "
                         f"images must fit in {MAX_IMAGE_BYTES_PER_REQUEST} (one gRPC message to the prefill worker)")
