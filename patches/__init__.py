"""The patch library: one module per patch, each declaring `PATCH = Patch(...)`, plus profiles.toml.

Shipped inside the wheel as `sm120patch.patches`. Conventions for a patch module:
- metadata at module level (`PATCH`), with the patch's facts table (`FACTS`,
  sm120patch.patchkit.facts: release ranges -> shape -> outcome), and the transform as a plain
  function made of the
  operations in `sm120patch.patchkit.operations` where they fit;
- its independent check, `def check(before, after, fact)` on `ast` with
  `sm120patch.patchkit.sitecheck`, directly above `PATCH = Patch(` and named there
  (`check=check`): what the real-release tier runs (docs/ARCHITECTURE.md);
- import libcst and the kit at the top: the catalog knows the patch by its row in registry.toml
  (module, target, title, files) and imports the module only when the patch is needed, so
  `sm120patch list`, `status` and `--help` start without loading libcst; the row and `PATCH`
  agree (the registry refuses a module that disagrees with its row);
- find the site with the kit's finders (`operations.one_def`, `one_of_defs`), which return the
  node; return the `Result` of the change (applied, already-applied, upstream), and where the
  transform stops early raise `Refuse(site, expected, found)` or `NotApplicable(site, reason)`
  (sm120patch.patchkit.model), as a libcst codemod raises `SkipFile`: the runner records the
  outcome they carry, and a finder's raise passes through untouched. Never thread a finder's
  result (`isinstance(found, Result)`: tests/test_kit_api.py reads the library for it); any
  other exception is a bug the runner turns into a refusal.
"""
