! mpirl.f90: the Fortran module over mpirl's C solver API (mpirl_solver.h), through
! iso_c_binding. Compile it with your program and link mpirl_solver.c (built by mpicc):
!
!     gfortran -c $(python -m mpirl.envs.solver --fortran)
!     mpicc -c -I$(python -m mpirl.envs.solver --include) $(python -m mpirl.envs.solver --source)
!     mpif90 solver.f90 mpirl.o mpirl_solver.o -o solver     (or link with mpicc ... -lgfortran)
!
!     use mpirl
!     type(mpirl_solver) :: s
!     call mpirl_init(s, ierr)                 ! ierr /= 0: the run ended before it began
!     comm = mpirl_group_comm(s)               ! a Fortran MPI handle (use mpi) for the group
!     do
!        call mpirl_next(s, action, seed, command)
!        if (command == MPIRL_END) exit
!        ...                                   ! MPIRL_RESET from seed, or MPIRL_STEP with action
!        call mpirl_send(s, obs, reward, terminated, truncated, ierr)
!     end do
!     call mpirl_finalize(s, code)
!
! The group communicator is an integer handle (MPI_Comm_c2f) for `use mpi`; with `use mpi_f08`
! wrap it: type(MPI_Comm) :: group; group%MPI_VAL = mpirl_group_comm(s).
module mpirl
   use iso_c_binding, only: c_ptr, c_null_ptr, c_int, c_long, c_double, c_char, c_null_char
   implicit none
   private

   integer, parameter, public :: MPIRL_RESET = 1, MPIRL_STEP = 2, MPIRL_END = 3

   type, public :: mpirl_solver
      type(c_ptr) :: handle = c_null_ptr
   end type mpirl_solver

   public :: mpirl_init, mpirl_group_comm, mpirl_solver_comm, mpirl_group, mpirl_num_groups, &
             mpirl_obs_size, mpirl_action_size, mpirl_seed, mpirl_exit_code, &
             mpirl_config_double, mpirl_config_long, mpirl_next, mpirl_send, mpirl_fail, &
             mpirl_finalize

   interface
      integer(c_int) function c_init(handle) bind(C, name="mpirl_init_f")
         import :: c_ptr, c_int
         type(c_ptr), intent(out) :: handle
      end function
      integer(c_int) function c_group_comm(handle) bind(C, name="mpirl_group_comm_f")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
      integer(c_int) function c_solver_comm(handle) bind(C, name="mpirl_solver_comm_f")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
      integer(c_long) function c_seed(handle) bind(C, name="mpirl_seed")
         import :: c_ptr, c_long
         type(c_ptr), value :: handle
      end function
      real(c_double) function c_config_double(handle, key, fallback) &
            bind(C, name="mpirl_config_double")
         import :: c_ptr, c_char, c_double
         type(c_ptr), value :: handle
         character(kind=c_char), intent(in) :: key(*)
         real(c_double), value :: fallback
      end function
      integer(c_long) function c_config_long(handle, key, fallback) &
            bind(C, name="mpirl_config_long")
         import :: c_ptr, c_char, c_long
         type(c_ptr), value :: handle
         character(kind=c_char), intent(in) :: key(*)
         integer(c_long), value :: fallback
      end function
      integer(c_int) function c_next(handle, action, seed) bind(C, name="mpirl_next")
         import :: c_ptr, c_int, c_long, c_double
         type(c_ptr), value :: handle
         real(c_double), intent(inout) :: action(*)
         integer(c_long), intent(out) :: seed
      end function
      integer(c_int) function c_send(handle, obs, reward, terminated, truncated) &
            bind(C, name="mpirl_send")
         import :: c_ptr, c_int, c_double
         type(c_ptr), value :: handle
         real(c_double), intent(in) :: obs(*)
         real(c_double), value :: reward
         integer(c_int), value :: terminated, truncated
      end function
      integer(c_int) function c_fail(handle, message) bind(C, name="mpirl_fail")
         import :: c_ptr, c_int, c_char
         type(c_ptr), value :: handle
         character(kind=c_char), intent(in) :: message(*)
      end function
      integer(c_int) function c_finalize(handle) bind(C, name="mpirl_finalize")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
   end interface

   ! The integer accessors share one C signature: int f(const mpirl_solver *).
   interface
      integer(c_int) function c_group(handle) bind(C, name="mpirl_group")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
      integer(c_int) function c_num_groups(handle) bind(C, name="mpirl_num_groups")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
      integer(c_int) function c_obs_size(handle) bind(C, name="mpirl_obs_size")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
      integer(c_int) function c_action_size(handle) bind(C, name="mpirl_action_size")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
      integer(c_int) function c_exit_code(handle) bind(C, name="mpirl_exit_code")
         import :: c_ptr, c_int
         type(c_ptr), value :: handle
      end function
   end interface

contains

   !> Initialize MPI (unless the program did), join the run, wait for the group's setup.
   !> ierr: 0, or MPIRL_END when the run ended before it began (then call mpirl_finalize).
   subroutine mpirl_init(s, ierr)
      type(mpirl_solver), intent(out) :: s
      integer, intent(out) :: ierr
      ierr = c_init(s%handle)
   end subroutine

   !> This env instance's ranks, as a Fortran MPI handle.
   integer function mpirl_group_comm(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_group_comm = c_group_comm(s%handle)
   end function

   !> Every solver process (all groups), as a Fortran MPI handle.
   integer function mpirl_solver_comm(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_solver_comm = c_solver_comm(s%handle)
   end function

   integer function mpirl_group(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_group = c_group(s%handle)
   end function

   integer function mpirl_num_groups(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_num_groups = c_num_groups(s%handle)
   end function

   integer function mpirl_obs_size(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_obs_size = c_obs_size(s%handle)
   end function

   integer function mpirl_action_size(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_action_size = c_action_size(s%handle)
   end function

   integer(c_long) function mpirl_seed(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_seed = c_seed(s%handle)
   end function

   integer function mpirl_exit_code(s)
      type(mpirl_solver), intent(in) :: s
      mpirl_exit_code = c_exit_code(s%handle)
   end function

   !> A number of env_config by key, or fallback.
   real(c_double) function mpirl_config_double(s, key, fallback)
      type(mpirl_solver), intent(in) :: s
      character(len=*), intent(in) :: key
      real(c_double), intent(in) :: fallback
      mpirl_config_double = c_config_double(s%handle, trim(key)//c_null_char, fallback)
   end function

   integer(c_long) function mpirl_config_long(s, key, fallback)
      type(mpirl_solver), intent(in) :: s
      character(len=*), intent(in) :: key
      integer(c_long), intent(in) :: fallback
      mpirl_config_long = c_config_long(s%handle, trim(key)//c_null_char, fallback)
   end function

   !> The next command (collective over the group): MPIRL_RESET (seed set, -1: none),
   !> MPIRL_STEP (action filled on every member) or MPIRL_END.
   subroutine mpirl_next(s, action, seed, command)
      type(mpirl_solver), intent(inout) :: s
      real(c_double), intent(inout) :: action(*)
      integer(c_long), intent(out) :: seed
      integer, intent(out) :: command
      seed = -1
      command = c_next(s%handle, action, seed)
   end subroutine

   !> Answer the last RESET or STEP (the group's root sends; the others return at once).
   subroutine mpirl_send(s, obs, reward, terminated, truncated, ierr)
      type(mpirl_solver), intent(inout) :: s
      real(c_double), intent(in) :: obs(*)
      real(c_double), intent(in) :: reward
      logical, intent(in) :: terminated, truncated
      integer, intent(out) :: ierr
      integer(c_int) :: term, trunc
      term = merge(1_c_int, 0_c_int, terminated)
      trunc = merge(1_c_int, 0_c_int, truncated)
      ierr = c_send(s%handle, obs, reward, term, trunc)
   end subroutine

   !> End the run with this one-line message (exit 2); call it on every member of the group.
   subroutine mpirl_fail(s, message)
      type(mpirl_solver), intent(inout) :: s
      character(len=*), intent(in) :: message
      integer(c_int) :: ignored
      ignored = c_fail(s%handle, trim(message)//c_null_char)
   end subroutine

   !> Free the solver's communicators, MPI_Finalize if mpirl_init began MPI; code: what to
   !> exit with (0).
   subroutine mpirl_finalize(s, code)
      type(mpirl_solver), intent(inout) :: s
      integer, intent(out) :: code
      code = c_finalize(s%handle)
      s%handle = c_null_ptr
   end subroutine

end module mpirl
