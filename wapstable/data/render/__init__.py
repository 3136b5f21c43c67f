"""Drawing expressions: the grammar that writes random LaTeX (`grammar`), mathtext's printed image of it
(`mathtext`), where each token is in that image (`glyph_hook`, `token_boxes`), and the same layout drawn as pen
strokes (`handwritten`, with the strokes of `glyphs` and the writers' placement of `placement`)."""
