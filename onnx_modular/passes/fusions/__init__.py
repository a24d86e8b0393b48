"""``optimize``'s fusions, one per module: each rewrites function bodies into one onnxruntime
kernel; :mod:`.base` holds what they share."""
