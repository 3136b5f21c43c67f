"""The data: samples (an image and its LaTeX tokens), the vocabulary, the sources that data.name picks (`sources`:
synthetic, crohme, wap_pkl, images), what they draw with (`render`: rendered expressions; `ink`: InkML), the one
on-disk cache (`cache`) and the batches of a split (`batches`)."""
