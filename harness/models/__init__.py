"""Models and their shapes: the models config, heads per model, the TP topology predictor, the tiny and the trained
local models."""
