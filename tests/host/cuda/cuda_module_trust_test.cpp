// CAI_CUDA_MODULE names code cai runs, so the module it names is trusted as a plugin is:
// refused when its file or directory is writable by group or others or owned by another
// user, with the variable, the path, the reason and the command that fixes it; loaded from
// the file that was checked otherwise. Each case loads in a child process of its own, since
// a process loads the module (or fails to) once.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/status.h"
#include "cuda/cuda_module.h"
#include "util/subprocess.h"

namespace {

namespace fs = std::filesystem;

struct Outcome {
  cai_status_code code = CAI_OK;
  std::string message;  // what Load() threw; "" when it loaded
};

// Load() in a child process with CAI_CUDA_MODULE=`module`.
Outcome LoadInChild(const fs::path& module) {
  int fds[2];
  if (::pipe(fds) != 0) return {CAI_INTERNAL, "pipe failed"};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::setenv("CAI_CUDA_MODULE", module.c_str(), 1);
    std::string report = std::to_string(int{CAI_OK}) + " ";
    try {
      cai::cuda::Load();
    } catch (const cai::Error& e) {
      report = std::to_string(int{e.code()}) + " " + e.what();
    }
    (void)!::write(fds[1], report.data(), report.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string report;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;) report.append(buffer, n);
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  const size_t space = report.find(' ');
  if (space == std::string::npos) return {CAI_INTERNAL, "child reported nothing"};
  return {static_cast<cai_status_code>(std::stoi(report.substr(0, space))),
          report.substr(space + 1)};
}

// A directory of mode 0700 with a copy of a shared library (not a CUDA module) in it.
class ModuleDir {
 public:
  ModuleDir() {
    char pattern[] = "/tmp/cai-cuda-module-XXXXXX";
    path_ = ::mkdtemp(pattern);
    fs::copy_file(FIXTURE_SO, module());
    ::chmod(module().c_str(), 0755);
  }
  ~ModuleDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path module() const { return path_ / "libcai_cuda.so"; }

 private:
  fs::path path_;
};

// Loads `dir`'s module after `open_up` (the module or its directory, a `kind`) was given
// `mode`, and expects the refusal that names the variable, the path, why and the chmod.
void ExpectRefusedAsWritable(const ModuleDir& dir, const fs::path& open_up, const char* kind,
                             const char* mode) {
  ::chmod(open_up.c_str(), std::stoi(mode, nullptr, 8));
  Outcome out = LoadInChild(dir.module());
  EXPECT_EQ(out.code, CAI_PERMISSION_DENIED) << out.message;
  CAI_EXPECT_CONTAINS(out.message, "CAI_CUDA_MODULE=" + dir.module().string() + ": " +
                                       open_up.string() + ": refused: " + kind +
                                       " is writable by group or others (mode " + mode +
                                       "), so anyone could replace the CUDA module's code; "
                                       "run 'chmod go-w " +
                                       open_up.string() + "'");
}

TEST(CudaModuleTrust, ModuleInADirectoryOthersMayWrite_IsRefusedNamingTheVariableAndTheChmod) {
  ModuleDir dir;
  ExpectRefusedAsWritable(dir, dir.path(), "directory", "0777");
}

TEST(CudaModuleTrust, ModuleWritableByGroup_IsRefusedNamingTheVariableAndTheChmod) {
  ModuleDir dir;
  ExpectRefusedAsWritable(dir, dir.module(), "file", "0775");
}

TEST(CudaModuleTrust, ModuleOwnedByAnotherUser_IsRefusedNamingTheChown) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a file to another user";
  ModuleDir dir;
  ASSERT_EQ(::chown(dir.module().c_str(), 65534, 65534), 0);
  Outcome out = LoadInChild(dir.module());
  EXPECT_EQ(out.code, CAI_PERMISSION_DENIED) << out.message;
  CAI_EXPECT_CONTAINS(out.message, "CAI_CUDA_MODULE=" + dir.module().string() + ": " +
                                       dir.module().string() + ": refused: owned by uid 65534");
  CAI_EXPECT_CONTAINS(out.message, "run 'sudo chown root " + dir.module().string() + "'");
}

TEST(CudaModuleTrust, TrustedModule_IsLoadedAndAskedForItsEntry) {
  // The fixture passes every check and is loaded; it is just not a CUDA module.
  ModuleDir dir;
  Outcome out = LoadInChild(dir.module());
  EXPECT_EQ(out.code, CAI_UNAVAILABLE) << out.message;
  CAI_EXPECT_CONTAINS(
      out.message, dir.module().string() + " has no cai_cuda_module_create: not a cai CUDA module");
}

}  // namespace
