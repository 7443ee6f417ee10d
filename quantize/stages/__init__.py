"""One module per stage (calibrate, quantize, export, eval, gate, and verify and publish run on
a finished run): explicit inputs in, files and a typed summary out. The order of a run and
each stage's declaration (name, help, wiring, disk need) are in quantize/pipeline/stages.py."""
