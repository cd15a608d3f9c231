"""Final stages that turn the optimized graph into something other than a graph: ONNX files."""
