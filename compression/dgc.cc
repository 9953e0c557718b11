// placeholder during development: replaced by the real codec
#include "compression/formats.h"
namespace sparrow::compression::detail { void register_dgc() {} }
