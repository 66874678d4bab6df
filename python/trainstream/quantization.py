"""``trainstream.quantization``: the import path docs/quantization.md documented before the
package had sub-packages; the module is ``trainstream.frozen.quantization``."""
from .frozen.quantization import (FORMATS, QuantizedTensor, QuantLinear, quant_report,  # noqa: F401
                                  quantize_model, quantize_tensor, set_fp8_matmul)
from .frozen.quantization import __all__  # noqa: F401
