/* Public C API of the omni-server native transport. Bound to Python by omni_transport/_ffi.py
 * (cffi ABI mode): every declaration here is mirrored there. */
#ifndef OMNI_TRANSPORT_H
#define OMNI_TRANSPORT_H

#include <stdint.h>

#define OMNI_API __attribute__((visibility("default")))

/* ABI version of this library; the Python side refuses a library of another version. */
OMNI_API uint32_t omni_transport_abi_version(void);

#endif
