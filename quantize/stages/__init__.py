"""One module per stage; the stage name is the module name, the CLI command, the Makefile
target and the key in the run manifest."""

STAGES = ("calibrate", "quantize", "export", "eval", "gate")
