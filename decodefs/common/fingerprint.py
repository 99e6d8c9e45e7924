"""The decoder fingerprint: what produced a version's arrays, as a digest and its description.

Every store entry's trailer and every L2 object's name carry the 16-byte
digest; a version's marker in the store records the description beside it.
The digest is the SHA-256 of the description's canonical JSON, so equal
descriptions give equal digests in every process. What goes into a
description (settings, library versions) is decode.py's to say
(``decoder_fingerprint``); this room knows neither Pillow nor the store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Fingerprint"]


@dataclass(frozen=True)
class Fingerprint:
    """What produced a version's arrays: settings plus decoding libraries.

    ``digest`` changes whenever anything here could change a pixel, so arrays
    decoded under other settings or another Pillow are never served as new.
    """

    digest: bytes  # 16 bytes, stored in every entry's trailer
    description: Mapping[str, object]

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def of(cls, description: Mapping[str, object]) -> Fingerprint:
        """The fingerprint of ``description`` (JSON values): the first 16 bytes of
        the SHA-256 of its canonical JSON."""
        canonical = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
        return cls(hashlib.sha256(canonical).digest()[:16], description)
