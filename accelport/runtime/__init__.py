"""What happens during a run: :mod:`.state` (the runtime that owns the plugin host, the matrix and
the selected backend), :mod:`.selection` (which backend, and why) and :mod:`.tracker` (steps and their records)."""
