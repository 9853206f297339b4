// CRC32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78), the checksum of iSCSI, ext4
// metadata, LevelDB and RocksDB blocks: it catches every burst error up to 32 bits and, unlike
// the zlib CRC32, has an x86 instruction (SSE4.2 `crc32`).
#pragma once

#include <cstddef>
#include <cstdint>

namespace cai::ckpt {

// The CRC32C of `data[0, bytes)` appended to bytes whose CRC32C is `crc` (0 for none), so
// Crc32c(Crc32c(0, a), b) == Crc32c(0, a + b). Uses the SSE4.2 instruction when this CPU has
// it (checked once, at run time), else the portable table code. Thread-safe.
uint32_t Crc32c(uint32_t crc, const void* data, size_t bytes);

// The two implementations behind Crc32c, for tests. Crc32cHardware may be called only when
// HasCrc32cHardware() is true.
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t bytes);
uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t bytes);
bool HasCrc32cHardware();

}  // namespace cai::ckpt
