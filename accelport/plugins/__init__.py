"""The plugin system, on pluggy: :mod:`.hookspecs` (the one place to read the extension API),
:mod:`.host` (loading, isolation, hook calls) and :mod:`.builtin` (the plugins accelport ships)."""
