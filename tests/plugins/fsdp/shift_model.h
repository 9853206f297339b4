// A TorchScript model for the buffer_dtype tests, built with LibTorch in its own translation
// unit so that the parity test itself compiles without it.
#ifndef CAI_TESTS_PLUGINS_FSDP_SHIFT_MODEL_H_
#define CAI_TESTS_PLUGINS_FSDP_SHIFT_MODEL_H_

#include <filesystem>
#include <string>

namespace cai::testing {

// Saves to `path` a language model over the byte vocabulary whose forward adds a buffer,
// tanh(embedding + (shift - 1000)) then a projection, with shift = 1000 + u, u uniform in
// [-0.5, 0.5). Near 1000 bf16's spacing is 4 and fp16's 0.5, so either dtype moves the shift
// by up to half a unit: a different model from the fp32 one. With `round_to` ("bf16" or
// "fp16") the buffer is saved already rounded through that dtype and back to fp32, which is
// what a forward over buffers cast to it computes.
void SaveShiftModel(const std::filesystem::path& path, const std::string& round_to = "");

}  // namespace cai::testing

#endif  // CAI_TESTS_PLUGINS_FSDP_SHIFT_MODEL_H_
