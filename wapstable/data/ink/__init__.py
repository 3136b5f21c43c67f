"""Online ink: InkML files read into strokes and truth (`inkml`), strokes rasterised (`raster`), drawn again in
another hand (`redraw`), each symbol's box from the traceGroups (`boxes`), and the bank of real symbols cut from
them for data.glyphs=crohme (`bank`)."""
