"""``accelport launch``: a plan built without importing torch (:mod:`.plan`), run to its end on
torchrun or torch_xla's launcher (:mod:`.run`), and the wrapper each worker starts in (:mod:`.worker`)."""
