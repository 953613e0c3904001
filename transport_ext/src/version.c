#include "omni_transport.h"

uint32_t omni_transport_abi_version(void) { return OMNI_ABI_VERSION; }
