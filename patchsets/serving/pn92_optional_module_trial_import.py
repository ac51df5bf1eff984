"""PN92: an optional extension that is installed but cannot be imported counts as absent.

What fails on 0.20.1: vLLM asks whether optional extensions are there through ``_has_module``
(``utils/import_utils.py:393-400``), which only looks the module up (``importlib.util.find_spec``).
An extension whose files are installed but whose native library cannot load (``nixl_ep`` built
against ``libcudart.so.12`` in a CUDA 13 image, vllm#39923 on the cu130 nightly of 2026-04-15
and vllm#42525 on 0.20.2rc1 nightlies; ``nixl`` 1.1.0 from PyPI installing its cu12 and cu13
builds into one ``nixl_ep`` directory) passes that check. ``fused_moe/all2all_utils.py:37-50``
then imports it at module level (``has_deep_ep``, ``has_mori``, ``has_nixl_ep``), and that module
is on the import path of every model: ``lora/utils.py:37`` imports ``FusedMoE``. The server dies
at model inspection with the extension's ``ImportError``, whatever model it serves.

What the patch does (written anew after Genesis PN92 and vLLM's own fix, whose behaviour it
follows): ``_has_module`` still looks the module up first and, when found, imports it; any
exception from that import makes the answer False, with a warning naming the module and the
traceback. A module that imports answers True as before, an absent one False as before; the
answer stays cached per name (``@cache``).

Upstream: vLLM 0.23.0 (vllm#40154) makes ``_has_module`` import the module and treat any failure
as absent; ``upstream_fix`` finds that trial import.

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM (``utils/import_utils.py:412``).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.22.1: APPLIES; ``_has_module`` is ``return importlib.util.find_spec(...) is not None``.
- 0.23.0 on: UPSTREAM, vLLM's own trial import.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import func, kiln_marked, marked, place, statements, with_marker

TARGET = "utils/import_utils.py"
HAS_MODULE = func("_has_module")
FIND_SPEC = m.Call(func=m.Attribute(value=m.Attribute(value=m.Name("importlib"), attr=m.Name("util")),
                                    attr=m.Name("find_spec")))
IMPORT_MODULE = m.Call(func=m.Attribute(value=m.Name("importlib"), attr=m.Name("import_module")))

TRIAL_IMPORT = '''
try:
    if importlib.util.find_spec(module_name) is None:
        return False
    importlib.import_module(module_name)
except Exception:
    # installed but not importable (a native library missing, a build for another CUDA):
    # absent, or the module-level imports guarded by this check fail every model
    logger.warning(
        "Optional module %s is installed but cannot be imported; treating it as absent.",
        module_name,
        exc_info=True,
    )
    return False
return True
'''


class TrialImport(Codemod):
    """``_has_module``'s lookup-only answer becomes a lookup followed by a trial import."""

    target = TARGET
    anchor = (HAS_MODULE, m.SimpleStatementLine(body=[m.Return(value=m.Comparison(left=FIND_SPEC))]))
    patched = (HAS_MODULE, m.Try(leading_lines=marked("PN92")))

    def rewrite(self, node):
        attempt, answer = statements(TRIAL_IMPORT)
        why = "an installed extension that cannot be imported is absent (vllm#40154)"
        attempt = with_marker(attempt, "PN92", why)
        attempt = attempt.with_changes(leading_lines=[*node.leading_lines, *attempt.leading_lines])
        return cst.FlattenSentinel([attempt, answer])


class PN92(Patch):
    id = "PN92"
    family = "serving"
    title = "An optional extension that is installed but fails to import counts as absent (_has_module trial import)"
    why = (
        "_has_module only looks an extension up, so a nixl_ep/deep_ep/mori whose native library "
        "cannot load passes it, and fused_moe's module-level import of it fails every model at "
        "startup. The module is imported on trial; a failure makes it absent, as vLLM does from 0.23.0."
    )
    upstream_refs = ("vllm#40154",)
    written_for = ">=0.20.1"
    edits = (TrialImport,)

    def upstream_fix(self, module_of) -> str | None:
        module = module_of(TARGET)
        if module is None:
            return None
        for has_module in find(module, HAS_MODULE):
            for attempt in find(has_module, m.Try()):
                if not kiln_marked(attempt) and find(attempt.body, IMPORT_MODULE):
                    return f"{place(TARGET, module, attempt)}: _has_module imports the module on trial (vllm#40154)"
        return None
