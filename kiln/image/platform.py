"""Which of the base's platforms a build reads, checked before any layer is.

Public API:
    check_base_platform(pin, resolved, base, platform)   the base has ``platform``; its manifest is
                                                         the one ``pin lock`` recorded for it
    check_base_triton(sm, found, pin)                    the base's Triton compiles for ``sm``

A pin locked with its platforms (``kiln.pins``) answers "does the base have linux/arm64?" with no
request at all; one locked before (a digest alone), or a build with ``--allow-unlocked`` on a
base that moved, asks the index (manifests only: no layer, no config of an index). A platform the
base lacks fails in one line naming the platforms it has.
"""

from __future__ import annotations

from kiln.errors import KilnError
from kiln.oci.image import RemoteImage
from kiln.pins import Pin
from kiln.source.image import ImageVllm
from kiln.targets import check_triton_for_sm


def check_base_platform(pin: Pin, resolved: str, base: RemoteImage, platform: str) -> None:
    recorded = dict(pin.platforms) if pin.digest == resolved else {}
    has = recorded or base.platforms()
    if platform not in has:
        raise KilnError(f"pin {pin.name}: {pin.image}@{resolved} has no {platform} image; it has "
                        f"{', '.join(sorted(has)) or 'none'}")
    if recorded and base.manifest().digest != recorded[platform]:
        raise KilnError(f"pin {pin.name}: the {platform} manifest of {pin.image}@{resolved} is "
                        f"{base.manifest().digest}, not {recorded[platform]} as pins.{pin.name}.platforms "
                        "records; re-lock the pin")


def check_base_triton(sm: int, found: ImageVllm, pin: Pin) -> None:
    check_triton_for_sm(sm, found.triton_version, f"pin {pin.name} ({found.image})")
