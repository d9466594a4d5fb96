"""ParamError: a request field that is out of range or of the wrong type.

Its own module, below everything that raises it: SamplingParams and StructuredOutputsParams
validate on construction, the grammar compiler, the logit controls and the engines refuse a
request with it, and the HTTP layer turns it into a 400 that names `param` without reading the
message.
"""


class ParamError(ValueError):
    """A request field is out of range or of the wrong type; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
