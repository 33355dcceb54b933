"""`dflash-trt bench`: acceptance and speed of DFlash side by side with the baselines users pick."""
